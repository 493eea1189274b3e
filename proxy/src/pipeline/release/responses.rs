//! A backend's own Responses answer under the output checks (a `responses = "native"` pool):
//! what the release remembers of the events it lets out — the response object, the output
//! items — so a cut can end with `response.incomplete` holding what the client saw, and the
//! events that state a text again written as the client was shown it.

use bytes::Bytes;
use serde_json::Value;

use super::{split_data, OutputRelease};
use crate::safety::texts::{self, Loc};

impl OutputRelease<'_> {
    /// A Responses event that is not a delta, as it goes out: the response object and the
    /// output items remembered (for a cut's ending), and texts it states again written as the
    /// client was shown them where a mask changed them.
    pub(super) fn noted(&mut self, bytes: Bytes, mut v: Value) -> Bytes {
        let masked: Vec<u32> =
            self.masks.iter().filter(|(_, ms)| ms.iter().any(|m| m.placed)).map(|(c, _)| *c).collect();
        let released = &self.released;
        let shown = |choice: u32, loc: Loc| -> Option<String> {
            masked.contains(&choice).then(|| released.get(&(choice, loc)).cloned().unwrap_or_default())
        };
        let changed = !masked.is_empty() && texts::restate(&mut v, &shown);
        let kind = v.get("type").and_then(Value::as_str).unwrap_or("");
        let index = v.get("output_index").and_then(Value::as_u64).unwrap_or(0) as u32;
        match kind {
            "response.created" | "response.in_progress" => self.response = v.get("response").cloned(),
            "response.output_item.added" | "response.output_item.done" => {
                if let Some(item) = v.get("item") {
                    self.items.insert(index, (item.clone(), kind.ends_with("done")));
                }
            }
            _ => {}
        }
        if !changed {
            return bytes;
        }
        let Some((head, _)) = split_data(&bytes) else { return bytes };
        Bytes::from(format!("{head}data: {v}\n\n"))
    }

    /// The ending of a cut Responses stream: `response.incomplete` with the output items as the
    /// client saw them (an item still open gets the text it was shown).
    pub(super) fn responses_cut(&mut self) -> String {
        let released = &self.released;
        let shown = |choice: u32, loc: Loc| released.get(&(choice, loc)).cloned();
        let output = std::mem::take(&mut self.items)
            .into_iter()
            .map(|(i, (item, done))| if done { item } else { texts::partial_item(item, i, &shown) })
            .collect();
        let event = texts::cut_response(self.response.as_ref(), output, self.last_seq);
        format!("event: response.incomplete\ndata: {event}\n\n")
    }
}

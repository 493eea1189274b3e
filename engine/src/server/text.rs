//! Turning generated ids into the text a client sees: streaming UTF-8 decoding, special tokens
//! skipped, and stop strings cut out (text that could still become a stop string is held back
//! until it cannot).

use warmpath_wire::tokenizer::{StreamDecoder, Tokenizer};

/// Text of one choice as it is generated.
#[derive(Debug)]
pub struct TextState {
    decoder: StreamDecoder,
    stops: Vec<String>,
    held: String,
    max_stop: usize,
    stopped: bool,
}

impl TextState {
    pub fn new(stops: Vec<String>) -> TextState {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        let max_stop = stops.iter().map(|s| s.len()).max().unwrap_or(0);
        TextState { decoder: StreamDecoder::new(), stops, held: String::new(), max_stop, stopped: false }
    }

    /// True once a stop string was seen: the choice is over.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// Text that `id` makes safe to send.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if self.stopped || tok.is_special(id) {
            return String::new();
        }
        let piece = self.decoder.push(tok, id).unwrap_or_default();
        self.held.push_str(&piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            self.stopped = true;
            let out = self.held[..at].to_owned();
            self.held.clear();
            return out;
        }
        // Keep the last max_stop-1 bytes (on a char boundary): a stop string may start there.
        let keep = self.max_stop.saturating_sub(1);
        let mut cut = self.held.len().saturating_sub(keep);
        while !self.held.is_char_boundary(cut) {
            cut -= 1;
        }
        let out = self.held[..cut].to_owned();
        self.held.drain(..cut);
        out
    }

    /// Whatever is held back, at the end of generation.
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let mut out = std::mem::take(&mut self.held);
        out.push_str(&self.decoder.finish());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(text: &str, stops: &[&str]) -> (String, bool) {
        let tok = Tokenizer::wp32k();
        let mut st = TextState::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for id in tok.encode(text) {
            out.push_str(&st.push(&tok, id));
        }
        out.push_str(&st.finish());
        (out, st.stopped())
    }

    #[test]
    fn stop_strings_cut_the_text() {
        assert_eq!(run("hello world. The end", &["."]), ("hello world".into(), true));
        assert_eq!(run("abc STOP def", &["STOP", "zzz"]), ("abc ".into(), true));
        assert_eq!(run("no stops here", &["xyz"]), ("no stops here".into(), false));
    }

    #[test]
    fn special_tokens_are_not_text() {
        let tok = Tokenizer::wp32k();
        let mut st = TextState::new(vec![]);
        let eos = tok.special_id(warmpath_wire::tokenizer::EOS).expect("special");
        assert_eq!(st.push(&tok, eos), "");
    }
}

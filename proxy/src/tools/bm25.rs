//! BM25 (Robertson–Spärck Jones; k1 = 1.2, b = 0.75) over tool definitions: the name (counted
//! three times, split at `_`, `-`, `.` and camelCase humps), the description, and parameter
//! names with their descriptions.

use std::collections::HashMap;

use super::def::CanonTool;

const K1: f64 = 1.2;
const B: f64 = 0.75;
const NAME_WEIGHT: usize = 3;

/// Words too common to tell tools apart.
const STOP: [&str; 24] = [
    "a", "an", "and", "are", "as", "at", "be", "by", "for", "from", "in", "into", "is", "it", "its", "of",
    "on", "or", "that", "the", "this", "to", "with", "you",
];

/// Lower-case words of `text` without stop words; camelCase is split (`readFile` → `read`,
/// `file`).
pub fn words(text: &str) -> Vec<String> {
    let mut w = raw_words(text);
    w.retain(|w| !STOP.contains(&w.as_str()));
    w
}

fn raw_words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut prev_lower = false;
    for c in text.chars() {
        if c.is_alphanumeric() {
            if c.is_uppercase() && prev_lower && !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            prev_lower = c.is_lowercase() || c.is_numeric();
            cur.extend(c.to_lowercase());
        } else {
            prev_lower = false;
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// An index over a fixed list of tools.
#[derive(Debug)]
pub struct Bm25 {
    /// term → (doc, term frequency)
    postings: HashMap<String, Vec<(u32, u32)>>,
    doc_len: Vec<u32>,
    avg_len: f64,
}

impl Bm25 {
    pub fn new(tools: &[std::sync::Arc<CanonTool>]) -> Bm25 {
        let mut postings: HashMap<String, Vec<(u32, u32)>> = HashMap::new();
        let mut doc_len = Vec::with_capacity(tools.len());
        for (d, t) in tools.iter().enumerate() {
            let mut tf: HashMap<String, u32> = HashMap::new();
            let name = words(&t.name);
            for _ in 0..NAME_WEIGHT {
                for w in &name {
                    *tf.entry(w.clone()).or_default() += 1;
                }
            }
            for text in std::iter::once(&t.description).chain(&t.params) {
                for w in words(text) {
                    *tf.entry(w).or_default() += 1;
                }
            }
            doc_len.push(tf.values().sum());
            for (w, n) in tf {
                postings.entry(w).or_default().push((d as u32, n));
            }
        }
        let avg_len = doc_len.iter().map(|&l| f64::from(l)).sum::<f64>() / doc_len.len().max(1) as f64;
        Bm25 { postings, doc_len, avg_len }
    }

    /// The best `k` documents for `query`, best first; ties by index. Documents that share no
    /// word with the query are not returned.
    pub fn search(&self, query: &str, k: usize) -> Vec<usize> {
        let n = self.doc_len.len() as f64;
        let mut score: HashMap<u32, f64> = HashMap::new();
        let mut terms = words(query);
        terms.sort();
        terms.dedup();
        for t in terms {
            let Some(list) = self.postings.get(&t) else { continue };
            let df = list.len() as f64;
            let idf = ((n - df + 0.5) / (df + 0.5) + 1.0).ln();
            for &(d, tf) in list {
                let tf = f64::from(tf);
                let len = f64::from(self.doc_len[d as usize]);
                let s = idf * tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * len / self.avg_len));
                *score.entry(d).or_default() += s;
            }
        }
        let mut ranked: Vec<(u32, f64)> = score.into_iter().collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked.into_iter().take(k).map(|(d, _)| d as usize).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn tool(name: &str, desc: &str, params: &[&str]) -> Arc<CanonTool> {
        Arc::new(CanonTool {
            name: name.into(),
            json: String::new(),
            line: String::new(),
            description: desc.into(),
            params: params.iter().map(|p| p.to_string()).collect(),
            defer_loading: false,
            hosted_search: false,
        })
    }

    #[test]
    fn words_split_names_and_camel_case() {
        assert_eq!(
            words("readFile_fromDisk v2.HTTP"),
            ["read", "file", "disk", "v2", "http"],
            "stop words dropped"
        );
    }

    #[test]
    fn the_best_match_ranks_first() {
        let tools = vec![
            tool("read_file", "Read a file from the workspace", &["path"]),
            tool("write_file", "Write text to a file", &["path", "text"]),
            tool("search_web", "Search the web for pages", &["query"]),
            tool("list_dir", "List the entries of a directory", &["path"]),
        ];
        let idx = Bm25::new(&tools);
        assert_eq!(idx.search("read the contents of a file", 2), [0, 1]);
        assert_eq!(idx.search("web search", 1), [2]);
        assert_eq!(idx.search("directory listing entries", 1), [3]);
        assert!(idx.search("zebra", 3).is_empty());
    }
}

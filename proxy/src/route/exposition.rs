//! Prometheus' text exposition format, read as the backends write it: comments and blank
//! lines skipped; a sample is `name{label="value",…} value [timestamp]`, where a label value may
//! hold escaped quotes, backslashes and newlines (`\"`, `\\`, `\n`) and any other character,
//! `,` and `}` included; values may be `NaN`, `+Inf`, `-Inf`. A line that does not parse is
//! skipped, never fatal: a backend's odd metric must not cost the routing its load.

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    pub name: &'a str,
    /// Label names and their unescaped values, as written.
    pub labels: Vec<(&'a str, String)>,
    pub value: f64,
}

impl Sample<'_> {
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(k, _)| *k == name).map(|(_, v)| v.as_str())
    }
}

/// Every sample of `text` that parses.
pub fn samples(text: &str) -> impl Iterator<Item = Sample<'_>> {
    text.lines().filter_map(sample)
}

fn sample(line: &str) -> Option<Sample<'_>> {
    let line = line.trim_start();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(|c: char| c == '{' || c.is_ascii_whitespace())?;
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = line[name_end..].trim_start();
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = read_labels(after, &mut labels)?;
    }
    // The value, then an optional timestamp (milliseconds), which routing has no use for.
    let mut fields = rest.split_ascii_whitespace();
    let value = parse_value(fields.next()?)?;
    if let Some(ts) = fields.next() {
        ts.parse::<i64>().ok()?;
    }
    if fields.next().is_some() {
        return None;
    }
    Some(Sample { name, labels, value })
}

/// Reads `name="value",…}`; what follows the closing brace.
fn read_labels<'a>(mut s: &'a str, out: &mut Vec<(&'a str, String)>) -> Option<&'a str> {
    loop {
        s = s.trim_start();
        if let Some(after) = s.strip_prefix('}') {
            return Some(after);
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        if key.is_empty() {
            return None;
        }
        s = s[eq + 1..].trim_start().strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '"' => break i,
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        };
        out.push((key, value));
        s = s[end + 1..].trim_start();
        if let Some(after) = s.strip_prefix(',') {
            s = after;
        } else if !s.starts_with('}') {
            return None;
        }
    }
}

fn parse_value(v: &str) -> Option<f64> {
    match v {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => v.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_labels_with_escapes_commas_and_braces_and_skips_timestamps() {
        let text = "# HELP m help with } and \"\n\
            # TYPE m gauge\n\
            m{a=\"x,y}\",b=\"say \\\"hi\\\"\\\\\\n\"} 3.5 1712345678901\n\
            plain 7\n\
            \n\
            inf{le=\"+Inf\"} +Inf\n\
            nan NaN\n\
            spaced { a = \"1\" , } 2\n";
        let s: Vec<Sample> = samples(text).collect();
        assert_eq!(s.len(), 5, "{s:?}");
        assert_eq!((s[0].name, s[0].value), ("m", 3.5));
        assert_eq!(s[0].label("a"), Some("x,y}"));
        assert_eq!(s[0].label("b"), Some("say \"hi\"\\\n"));
        assert_eq!((s[1].name, s[1].value, s[1].labels.len()), ("plain", 7.0, 0));
        assert_eq!((s[2].label("le"), s[2].value), (Some("+Inf"), f64::INFINITY));
        assert!(s[3].value.is_nan());
        assert_eq!((s[4].name, s[4].label("a"), s[4].value), ("spaced", Some("1"), 2.0));
    }

    #[test]
    fn skips_what_does_not_parse() {
        for bad in [
            "m{a=\"unclosed} 1",
            "m{a=1} 1",
            "m{=\"x\"} 1",
            "m 1 2 3",
            "m one",
            "m 1 notatime",
            "{a=\"x\"} 1",
            "m{a=\"x\" b=\"y\"} 1",
            "m",
        ] {
            assert_eq!(samples(bad).count(), 0, "{bad:?} parsed");
        }
    }
}

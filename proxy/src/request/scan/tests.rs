use proptest::prelude::*;

use super::*;

/// The end of the value at `at` as serde_json finds it (which parses it whole).
fn serde_end(text: &str, at: usize) -> Option<usize> {
    let mut de = serde_json::Deserializer::from_str(&text[at..]);
    let v: &serde_json::value::RawValue = serde::Deserialize::deserialize(&mut de).ok()?;
    Some(at + v.get().len())
}

/// JSON values with the hard parts: strings with backslash runs, escaped quotes and brackets,
/// nesting, values longer than a block.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::Bool),
        any::<i64>().prop_map(serde_json::Value::from),
        (-1e9f64..1e9).prop_map(serde_json::Value::from),
        "([a-z{}\\[\\]\"\\\\ ]|\\\\\\\\|\u{e9}|\u{1F600}){0,90}".prop_map(serde_json::Value::String),
    ];
    leaf.prop_recursive(6, 64, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::btree_map("[a-z\"\\\\{]{0,8}", inner, 0..6)
                .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn a_value_ends_where_serde_json_says(v in json_value(), pad in 0usize..70, pretty in any::<bool>()) {
        let text = if pretty { serde_json::to_string_pretty(&v).unwrap() } else { v.to_string() };
        // Shifted by `pad` so block edges fall everywhere, and followed by more text.
        let doc = format!("{}{text} ,1", " ".repeat(pad));
        let want = serde_end(&doc, pad);
        prop_assert_eq!(value_end(doc.as_bytes(), pad).ok(), want);
        // Every classifier's scan, not only the one this CPU picks.
        if matches!(doc.as_bytes()[pad], b'[' | b'{') {
            prop_assert_eq!(container_end_with::<Plain>(doc.as_bytes(), pad).ok(), want);
            #[cfg(target_arch = "x86_64")]
            prop_assert_eq!(container_end_with::<simd::Sse2>(doc.as_bytes(), pad).ok(), want);
        }
        if doc.as_bytes()[pad] == b'"' {
            prop_assert_eq!(string_end_with::<Plain>(doc.as_bytes(), pad).ok(), want);
        }
    }

    #[test]
    fn an_object_reads_as_serde_json_reads_it(v in prop::collection::btree_map("[a-z\"\\\\]{0,6}", json_value(), 0..8)) {
        let text = serde_json::to_string_pretty(&v).unwrap();
        let fields = object_fields(&text).expect("a well-formed object");
        let keys: Vec<String> = fields.iter().map(|(k, _)| k.to_string()).collect();
        prop_assert_eq!(keys, v.keys().cloned().collect::<Vec<_>>());
        for ((_, raw), want) in fields.iter().zip(v.values()) {
            let got: serde_json::Value = serde_json::from_str(raw).unwrap();
            prop_assert_eq!(&got, want);
        }
    }

    #[test]
    fn every_classifier_agrees_with_the_plain_one(bytes in prop::collection::vec(prop_oneof![
        Just(b'"'), Just(b'\\'), Just(b'{'), Just(b'['), Just(b'}'), Just(b']'), Just(b'{' ^ 0x20), Just(b'}' ^ 0x20), any::<u8>()
    ], 64)) {
        let block: [u8; 64] = bytes.try_into().unwrap();
        let plain = Plain::classify(&block);
        #[cfg(target_arch = "x86_64")]
        {
            prop_assert_eq!(simd::Sse2::classify(&block), plain);
            if simd::has_avx2() {
                // The AVX2 scan (its classifier inlined into code compiled for AVX2) ends
                // where the SSE2 one does.
                let text: Vec<u8> = block.iter().map(|&c| if c >= 0x80 { b'x' } else { c }).collect();
                let mut doc = b"[".to_vec();
                doc.extend_from_slice(&text);
                prop_assert_eq!(simd::container_end_avx2(&doc, 0), container_end_with::<simd::Sse2>(&doc, 0));
                prop_assert_eq!(simd::string_end_avx2(&doc, 1), string_end_with::<simd::Sse2>(&doc, 1));
            }
        }
    }

    #[test]
    fn the_carry_less_prefix_xor_is_the_shifted_one(x in any::<u64>()) {
        #[cfg(target_arch = "x86_64")]
        if simd::has_avx2() {
            prop_assert_eq!(<simd::Avx2 as Classifier>::prefix_xor(x), <Plain as Classifier>::prefix_xor(x));
        }
        let _ = x;
    }

    #[test]
    fn no_input_panics(text in "[ {}\\[\\]\":,a-z0-9\\\\]{0,200}") {
        let _ = object_fields(&text);
        let _ = array_elements(&text);
    }
}

#[test]
fn backslash_runs_across_a_block_edge_escape_by_parity() {
    for run in 0..6 {
        for at in 50..70 {
            // A string whose backslash run ends at byte `at`, then a quote that the run
            // escapes when it is odd.
            let mut s = String::from("\"");
            s.push_str(&"x".repeat(at - 1 - run));
            s.push_str(&"\\".repeat(run));
            s.push_str("\"\"]\"");
            let want = serde_end(&s, 0);
            assert_eq!(value_end(s.as_bytes(), 0).ok(), want, "run {run} ending at {at}");
        }
    }
}

#[test]
fn bad_text_is_refused_with_where() {
    let err = |t: &str| object_fields(t).expect_err(t).describe(t.as_bytes());
    assert_eq!(err("{not json"), "key must be a string at line 1 column 2");
    assert!(err("[1]").starts_with("expected a JSON object"));
    assert!(err("{\"a\":1} x").starts_with("trailing characters"));
    assert!(
        err("{\"a\":[1}").starts_with("EOF while parsing an object"),
        "crossed brackets end the value early"
    );
    assert!(err("{\"a\":\"open").starts_with("EOF while parsing a string"));
    assert!(err("{\"a\" 1}").starts_with("expected `:`"));
    assert!(err("{\"a\":1 \"b\":2}").starts_with("expected `,` or `}`"));
    assert!(err("{\"a\":}").starts_with("expected value"));
    let deep = format!("{{\"a\":{}{}}}", "[".repeat(129), "]".repeat(129));
    assert!(err(&deep).starts_with("recursion limit exceeded"));
    let ok = format!("{{\"a\":{}{}}}", "[".repeat(127), "]".repeat(127));
    assert!(object_fields(&ok).is_ok());
    assert_eq!(err("{\"a\":1,\n \"b\"}"), "expected `:` at line 2 column 5");
}

#[test]
fn keys_with_escapes_are_unescaped() {
    let f = object_fields(r#"{"mo\u0064el": "m", "plain": [1, {"x": "]"}]}"#).unwrap();
    assert_eq!(f[0].0, "model");
    assert!(matches!(f[0].0, Cow::Owned(_)));
    assert!(matches!(f[1].0, Cow::Borrowed("plain")));
    assert_eq!(f[1].1, r#"[1, {"x": "]"}]"#);
    assert_eq!(array_elements(f[1].1).unwrap(), Some(vec!["1", r#"{"x": "]"}"#]));
    assert_eq!(array_elements("\"x\"").unwrap(), None);
    assert_eq!(array_elements(" [ ] ").unwrap(), Some(vec![]));
}

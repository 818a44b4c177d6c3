//! A grammar over real vocabularies: valid documents pass token by token, each token inside
//! the mask before it; invalid ones are refused; a rewind continues the same document.

use std::sync::Arc;

use constrain::{grammar, Purpose, Vocabulary};
use serde_json::json;
use text::Tokenizer;

fn tokenizer(path: &std::path::Path) -> Arc<Tokenizer> {
    let f = gguf::GgufFile::open(path).unwrap();
    Arc::new(Tokenizer::from_header(f.header()).unwrap())
}

fn tiny() -> Arc<Tokenizer> {
    tokenizer(&testkit::write_tiny_model(
        &testkit::TinySpec::default(),
        "constrain-tiny",
    ))
}

fn schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "array", "items": {"type": "integer"}},
            "unit": {"enum": ["c", "f"]}
        },
        "required": ["city", "days", "unit"],
        "additionalProperties": false
    })
}

/// Feeds `doc` through a fresh constraint: whether every token was allowed, and whether the
/// end token was allowed after it.
fn walk(vocab: &Arc<Vocabulary>, tok: &Tokenizer, g: &str, doc: &str) -> (bool, bool) {
    let mut c = vocab.compile(g).unwrap();
    let ids = tok.encode(doc, false, false);
    for k in 0..ids.len() {
        let mask = c.mask().unwrap();
        if !model::sampling::allowed(&mask, ids[k] as usize) {
            return (false, false);
        }
        c.advance(&ids[..=k]).unwrap();
    }
    let end = tok.eot.or(tok.eos).unwrap() as usize;
    (true, model::sampling::allowed(&c.mask().unwrap(), end))
}

#[test]
fn documents_inside_the_schema_pass_and_others_do_not() {
    for tok in [
        tiny(),
        tokenizer(&testkit::named_model("qwen2.5-coder-0.5b")),
    ] {
        let vocab = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
        let g = grammar::json_schema(&schema()).unwrap();
        let good = r#"{"city": "Paris", "days": [1, 2], "unit": "c"}"#;
        assert_eq!(walk(&vocab, &tok, &g, good), (true, true));
        // Missing a required key, a wrong enum value, free whitespace: refused on the way.
        for bad in [
            r#"{"city": "Paris", "unit": "c"}"#,
            r#"{"city": "Paris", "days": [], "unit": "k"}"#,
            r#"{ "city": "Paris"}"#,
        ] {
            assert!(!walk(&vocab, &tok, &g, bad).0, "{bad}");
        }
        // Incomplete: every token allowed, the end not yet.
        assert_eq!(walk(&vocab, &tok, &g, r#"{"city": "Pa"#), (true, false));
        // Any object.
        assert_eq!(
            walk(
                &vocab,
                &tok,
                &grammar::json_object(),
                r#"{"a": [true, null]}"#
            ),
            (true, true)
        );
        assert!(!walk(&vocab, &tok, &grammar::json_object(), "[1]").0);
    }
}

/// A vocabulary built only to check grammars (no precomputed token sets) computes the same
/// masks as the sampler's, token after token, inside strings, numbers and whitespace.
#[test]
fn a_checking_vocabulary_computes_the_masks_a_sampling_one_does() {
    let tok = tokenizer(&testkit::named_model("qwen2.5-coder-0.5b"));
    let masks = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
    let checks = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Checks).unwrap());
    let g = grammar::json_schema(&schema()).unwrap();
    let ids = tok.encode(
        r#"{"city": "Rio de Janeiro, a long name", "days": [12, 3], "unit": "c"}"#,
        false,
        false,
    );
    let (mut a, mut b) = (masks.compile(&g).unwrap(), checks.compile(&g).unwrap());
    for k in 0..=ids.len() {
        assert_eq!(a.mask().unwrap(), b.mask().unwrap(), "after {k} tokens");
        if k < ids.len() {
            a.advance(&ids[..=k]).unwrap();
            b.advance(&ids[..=k]).unwrap();
        }
    }
    assert!(a.is_complete() && b.is_complete());
}

#[test]
fn a_rewound_constraint_continues_the_same_document() {
    let tok = tiny();
    let vocab = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
    let g = grammar::json_schema(&schema()).unwrap();
    let ids = tok.encode(
        r#"{"city": "Oslo", "days": [3], "unit": "f"}"#,
        false,
        false,
    );
    let mut c = vocab.compile(&g).unwrap();
    c.advance(&ids).unwrap();
    assert!(c.is_complete());
    for keep in [ids.len() - 1, ids.len() / 2, 0] {
        c.rewind(keep);
        assert_eq!(c.consumed(), keep);
        assert!(!c.is_complete());
        c.advance(&ids).unwrap();
        assert!(c.is_complete(), "after a rewind to {keep}");
    }
    // A token outside the grammar is an error, not a panic.
    let mut c = vocab.compile(&g).unwrap();
    assert!(c.advance(&tok.encode("[", false, false)).is_err());
}

#[test]
fn unsupported_schema_features_and_garbage_are_named() {
    let tok = tiny();
    let vocab = Arc::new(Vocabulary::new(tok, Purpose::Masks).unwrap());
    let g = grammar::json_schema(
        &json!({"type": "object", "patternProperties": {"^a": {}}, "unevaluatedProperties": false}),
    )
    .unwrap();
    let err = vocab.compile(&g).unwrap_err().to_string();
    assert!(err.contains("unevaluatedProperties"), "{err}");
    assert!(vocab.compile("not json").is_err());
    assert!(vocab
        .compile(r#"{"grammars": [{"lark_grammar": "start: ("}]}"#)
        .is_err());
}

const REQUIRED: grammar::CallRules = grammar::CallRules {
    lazy: false,
    parallel: true,
    format: grammar::CallFormat::Hermes,
};

#[test]
fn tool_calls_parse_and_their_arguments_match() {
    let tok = tokenizer(&testkit::named_model("qwen2.5-coder-0.5b"));
    let vocab = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
    let weather = [grammar::Tool {
        name: "get_weather".into(),
        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
    }];
    let g = grammar::tool_calls(&weather, REQUIRED).unwrap();
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    assert_eq!(walk(&vocab, &tok, &g, call), (true, true));
    let wrong = "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    assert!(!walk(&vocab, &tok, &g, wrong).0);
    assert!(!walk(&vocab, &tok, &g, "Sure! <tool_call>").0);
    let two = format!("{call}\n{call}");
    assert_eq!(walk(&vocab, &tok, &g, &two), (true, true));
    let one = grammar::tool_calls(
        &weather,
        grammar::CallRules {
            lazy: false,
            parallel: false,
            format: grammar::CallFormat::Hermes,
        },
    )
    .unwrap();
    assert_eq!(walk(&vocab, &tok, &one, call), (true, true));
    assert!(!walk(&vocab, &tok, &one, &two).0, "one call only");
}

#[test]
fn a_lazy_tool_grammar_leaves_text_free_and_holds_every_call_it_opens() {
    let tok = tokenizer(&testkit::named_model("qwen2.5-coder-0.5b"));
    let vocab = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
    let weather = [grammar::Tool {
        name: "get_weather".into(),
        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}),
    }];
    let rules = grammar::CallRules {
        lazy: true,
        parallel: true,
        format: grammar::CallFormat::Hermes,
    };
    let g = grammar::tool_calls(&weather, rules).unwrap();
    let call = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    // Free text, with angle brackets and partial tags in it, ends whenever it likes.
    for text in [
        "Sure, it is sunny.",
        "a < b and <b>bold</b>, <tool_ is not a tag",
        "",
    ] {
        assert_eq!(walk(&vocab, &tok, &g, text), (true, true), "{text:?}");
    }
    // Text then calls, or calls alone.
    for answer in [
        format!("Let me check.\n{call}"),
        call.to_string(),
        format!("{call}\n{call}"),
    ] {
        assert_eq!(walk(&vocab, &tok, &g, &answer), (true, true), "{answer:?}");
    }
    // A call once opened must be a call of an offered tool with matching arguments, and
    // it must be finished; nothing but another call follows it.
    let unknown = "ok <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
    let bad_args =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"town\": 1}}\n</tool_call>";
    let broken = "<tool_call>\n{{\"name\": \"get_weather\"}}}";
    for answer in [unknown, bad_args, broken] {
        assert!(!walk(&vocab, &tok, &g, answer).0, "{answer:?}");
    }
    assert_eq!(
        walk(&vocab, &tok, &g, "Checking <tool_call>"),
        (true, false),
        "an opened call cannot end the answer"
    );
    assert!(!walk(&vocab, &tok, &g, &format!("{call} and more text")).0);
    // A call written bare at the start, as Qwen2.5-Coder writes them (fenced or not), is
    // held once it names an offered tool; a JSON object naming another stays text.
    for bare in [
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
        "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```",
        "<tools>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tools>",
        // A bare call, then a tagged one.
        &format!("{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"Paris\"}}}}\n{call}"),
    ] {
        let bare: &str = bare;
        assert_eq!(walk(&vocab, &tok, &g, bare), (true, true), "{bare:?}");
    }
    assert!(
        !walk(
            &vocab,
            &tok,
            &g,
            "{\"name\": \"get_weather\", \"arguments\": {\"town\": 1}}"
        )
        .0
    );
    for text in [
        "```json\n{\"name\": \"get_author\", \"arguments\": {}}\n```",
        "{\"a\": 1} is JSON",
        "Here: {\"name\": \"get_weather\"}",
    ] {
        assert_eq!(walk(&vocab, &tok, &g, text), (true, true), "{text:?}");
    }
    let one = grammar::tool_calls(
        &weather,
        grammar::CallRules {
            lazy: true,
            parallel: false,
            format: grammar::CallFormat::Hermes,
        },
    )
    .unwrap();
    assert_eq!(walk(&vocab, &tok, &one, call), (true, true));
    assert!(!walk(&vocab, &tok, &one, &format!("{call}\n{call}")).0);
}

#[test]
fn calls_in_the_json_format_are_bare_objects_with_parameters() {
    let tok = tokenizer(&testkit::named_model("qwen2.5-coder-0.5b"));
    let vocab = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
    let weather = [grammar::Tool {
        name: "get_weather".into(),
        parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}),
    }];
    let call = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}";
    for (lazy, parallel) in [(false, false), (true, false), (true, true)] {
        let rules = grammar::CallRules {
            lazy,
            parallel,
            format: grammar::CallFormat::Json,
        };
        let g = grammar::tool_calls(&weather, rules).unwrap();
        assert_eq!(walk(&vocab, &tok, &g, call), (true, true), "{rules:?}");
        let tagged = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        assert_eq!(
            walk(&vocab, &tok, &g, tagged).1,
            lazy,
            "{rules:?}: tags are text under auto, refused otherwise"
        );
        let two = format!("{call}\n{call}");
        assert_eq!(
            walk(&vocab, &tok, &g, &two) == (true, true),
            parallel,
            "{rules:?}"
        );
        assert_eq!(
            walk(&vocab, &tok, &g, "Sunny.") == (true, true),
            lazy,
            "{rules:?}"
        );
    }
}

#[test]
#[ignore = "prints build, compile and mask timings and asserts nothing about them (tests never assert on speed); run by hand with --release --nocapture"]
fn vocabulary_build_time() {
    let tok = tokenizer(&testkit::named_model("qwen2.5-coder-0.5b"));
    let t = std::time::Instant::now();
    let vocab = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
    eprintln!("vocabulary: {:?}", t.elapsed());
    let g = grammar::json_schema(&schema()).unwrap();
    let t = std::time::Instant::now();
    let mut c = vocab.compile(&g).unwrap();
    eprintln!("compile: {:?}", t.elapsed());
    let ids = tok.encode(
        r#"{"city": "Paris", "days": [1, 2], "unit": "c"}"#,
        false,
        false,
    );
    let t = std::time::Instant::now();
    for k in 0..ids.len() {
        c.mask().unwrap();
        c.advance(&ids[..=k]).unwrap();
    }
    eprintln!(
        "{} masks: {:?} each",
        ids.len(),
        t.elapsed() / ids.len() as u32
    );
}

#[test]
fn a_tool_whose_parameters_use_definitions_compiles_and_holds() {
    let tok = tiny();
    let vocab = Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap());
    // As pydantic writes a model with a nested one.
    let g = grammar::tool_calls(
        &[grammar::Tool {
            name: "book".into(),
        parameters: json!({
            "type": "object",
            "properties": {"guest": {"$ref": "#/$defs/Guest"}},
            "required": ["guest"],
            "$defs": {"Guest": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": false}}
        }),
        }],
        REQUIRED,
    )
    .unwrap();
    let call = "<tool_call>\n{\"name\": \"book\", \"arguments\": {\"guest\": {\"name\": \"Ada\"}}}\n</tool_call>";
    assert_eq!(walk(&vocab, &tok, &g, call), (true, true));
    let wrong =
        "<tool_call>\n{\"name\": \"book\", \"arguments\": {\"guest\": {\"age\": 3}}}\n</tool_call>";
    assert!(!walk(&vocab, &tok, &g, wrong).0);
}

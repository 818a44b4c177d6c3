//! Schemas at and over the limits, on Qwen2.5's vocabulary: what the limits admit compiles,
//! masks and completes a document that uses every property (the engine never gives up
//! mid-document); what they refuse is refused before any compiling, naming the limit; a
//! `$ref` cycle and an object far too wide are refused by `check` with a short message, on
//! a stack of their own, never by a crash.

use std::sync::Arc;
use std::time::{Duration, Instant};

use constrain::limits::LIMITS;
use constrain::{grammar, Error, Purpose, Vocabulary};
use serde_json::{json, Value};
use text::Tokenizer;

fn qwen() -> (Arc<Vocabulary>, Arc<Tokenizer>) {
    let f = gguf::GgufFile::open(testkit::named_model("qwen2.5-coder-0.5b")).unwrap();
    let tok = Arc::new(Tokenizer::from_header(f.header()).unwrap());
    (
        Arc::new(Vocabulary::new(Arc::clone(&tok), Purpose::Masks).unwrap()),
        tok,
    )
}

/// An object of `n` optional integer properties `p0`.. (none required: the hard case, every
/// property may follow any earlier one).
fn wide(n: usize) -> Value {
    let props: serde_json::Map<String, Value> = (0..n)
        .map(|i| (format!("p{i}"), json!({"type": "integer"})))
        .collect();
    json!({"type": "object", "properties": props, "additionalProperties": false})
}

/// The document that gives each property `p{i}` of `which` the value `i`.
fn document(which: impl Iterator<Item = usize>) -> String {
    let fields: Vec<String> = which.map(|i| format!("\"p{i}\": {i}")).collect();
    format!("{{{}}}", fields.join(", "))
}

/// Feeds `doc` token by token: the longest mask time, or the token the grammar refused.
fn walk(vocab: &Arc<Vocabulary>, tok: &Tokenizer, g: &str, doc: &str) -> Result<Duration, String> {
    let mut c = vocab.compile(g).map_err(|e| e.to_string())?;
    let ids = tok.encode(doc, false, false);
    let mut slowest = Duration::ZERO;
    for k in 0..ids.len() {
        let t = Instant::now();
        let mask = c.mask().map_err(|e| format!("token {k}: {e}"))?;
        slowest = slowest.max(t.elapsed());
        if !model::sampling::allowed(&mask, ids[k] as usize) {
            return Err(format!("token {k} ({}) refused", ids[k]));
        }
        c.advance(&ids[..=k]).map_err(|e| e.to_string())?;
    }
    let end = tok.eot.or(tok.eos).unwrap() as usize;
    let mask = c.mask().map_err(|e| e.to_string())?;
    if !model::sampling::allowed(&mask, end) {
        return Err("the end token is refused after the whole document".into());
    }
    Ok(slowest)
}

#[test]
fn the_widest_object_accepted_completes_with_every_property() {
    let (vocab, tok) = qwen();
    let n = LIMITS.max_object_properties;
    let g = grammar::json_schema(&wide(n)).unwrap();
    let t = Instant::now();
    vocab.check(&g).unwrap();
    let check = t.elapsed();
    let doc = document(0..n);
    let slowest = walk(&vocab, &tok, &g, &doc).unwrap();
    // Every other property, too: an optional one may be left out anywhere.
    let sparse = document((0..n).step_by(2));
    walk(&vocab, &tok, &g, &sparse).unwrap();
    eprintln!("{n} optional properties: check {check:?}, slowest mask {slowest:?}");
}

#[test]
fn tool_calls_at_the_total_limit_compile_and_check() {
    let (vocab, _) = qwen();
    let per = LIMITS.max_object_properties;
    let n_tools = LIMITS.max_total_properties / per - 1;
    let tools: Vec<grammar::Tool> = (0..n_tools)
        .map(|i| grammar::Tool {
            name: format!("tool_{i}"),
            parameters: wide(per),
        })
        .collect();
    let g = grammar::tool_calls(
        &tools,
        grammar::CallRules {
            lazy: false,
            parallel: true,
            format: grammar::CallFormat::Hermes,
        },
    )
    .unwrap();
    let t = Instant::now();
    vocab.check(&g).unwrap();
    eprintln!(
        "{n_tools} tools of {per} properties: check {:?}",
        t.elapsed()
    );
}

#[test]
fn schemas_over_a_limit_are_refused_before_compiling_and_name_it() {
    for n in [7_000, 10_000, 50_000] {
        let schema = wide(n);
        let t = Instant::now();
        match grammar::json_schema(&schema) {
            Err(Error::TooLarge { limit, message }) => {
                assert_eq!(limit, "max_object_properties");
                assert!(message.contains(&n.to_string()), "{message}");
            }
            other => panic!("{n} properties: {other:?}"),
        }
        assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    }
    let huge_const = json!({"const": "x".repeat(3 << 20)});
    assert!(matches!(
        grammar::json_schema(&huge_const),
        Err(Error::TooLarge {
            limit: "max_schema_literal_bytes",
            ..
        })
    ));
}

#[test]
fn a_ref_cycle_is_refused_in_a_few_words() {
    let (vocab, _) = qwen();
    for schema in [
        json!({"$ref": "#"}),
        json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
        json!({"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}, "required": ["x"]}),
    ] {
        // Refused by the limits' walk; and the engine alone, given such a grammar, is refused
        // by the check rather than failing mid-document.
        let m = grammar::json_schema(&schema)
            .expect_err(&schema.to_string())
            .to_string();
        assert!(m.len() < 300 && !m.contains('\n'), "{m}");
        let raw = serde_json::to_string(&llguidance::api::TopLevelGrammar::from_json_schema(
            schema.clone(),
        ))
        .unwrap();
        if let Err(e) = vocab.check(&raw) {
            let m = e.to_string();
            assert!(m.len() < 300 && !m.contains('\n'), "{m}");
        }
    }
}

/// What the engine would refuse on the last shard after a token, the check refuses first:
/// any object wider than the limit, compiled directly, fails or is slow; under the limit it
/// never does (the widest accepted case is above).
#[test]
fn the_engine_alone_fails_far_past_the_limit() {
    let (vocab, tok) = qwen();
    let n = 1_000;
    let raw = serde_json::to_string(&llguidance::api::TopLevelGrammar::from_json_schema(wide(n)))
        .unwrap();
    let doc = document(0..n);
    assert!(
        walk(&vocab, &tok, &raw, &doc).is_err(),
        "1000 optional properties completed: the limit could be raised"
    );
}

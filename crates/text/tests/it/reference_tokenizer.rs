//! The tokenizer agrees with llama.cpp on every entry of `tokenizer_public.json`, with and
//! without special-token parsing, and detokenizes back to the reference text.

use serde_json::Value;
use text::{StreamDecoder, Tokenizer};

fn tokenizer() -> Tokenizer {
    let f = gguf::GgufFile::open(testkit::real_model()).unwrap();
    Tokenizer::from_header(f.header()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn every_reference_string_tokenizes_and_detokenizes_exactly() {
    let tok = tokenizer();
    let reference: Value =
        serde_json::from_str(&testkit::reference_text("tokenizer_public.json")).unwrap();
    let entries = reference["entries"].as_array().unwrap();
    assert_eq!(entries.len(), 30);
    let mut failures = Vec::new();
    for e in entries {
        let name = e["name"].as_str().unwrap();
        let text = e["text"].as_str().unwrap();
        for (parse_special, ids_key, detok_key) in [
            (false, "ids", "detokenized"),
            (true, "ids_parse_special", "detokenized_parse_special"),
        ] {
            let want = ids(&e[ids_key]);
            let got = tok.encode(text, true, parse_special);
            if got != want {
                failures.push(format!(
                    "{name} (parse_special={parse_special}): got {got:?}, want {want:?}"
                ));
            }
            let back = tok.decode(&want, true).unwrap();
            if back != e[detok_key].as_str().unwrap() {
                failures.push(format!("{name}: detokenized {back:?}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn streaming_detokenizer_reassembles_multibyte_text_token_by_token() {
    let tok = tokenizer();
    let text = "Café 東京 👍🏽 done";
    let ids = tok.encode(text, false, false);
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    for id in ids {
        let piece = d.push(&tok, id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "half a character was emitted: {piece:?}"
        );
        out.push_str(&piece);
    }
    out.push_str(&d.finish());
    assert_eq!(out, text);
}

#[test]
fn chat_prompt_of_the_reference_tokenizes_to_its_ids() {
    let f = gguf::GgufFile::open(testkit::real_model()).unwrap();
    let tok = Tokenizer::from_header(f.header()).unwrap();
    let reference: Value =
        serde_json::from_str(&testkit::reference_text("greedy_public.json")).unwrap();
    let chat = reference["greedy"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g.get("chat_messages").is_some())
        .unwrap();
    let messages: Vec<text::ChatMessage> =
        serde_json::from_value(chat["chat_messages"].clone()).unwrap();
    let tmpl = text::ChatTemplate::new(f.header().str("tokenizer.chat_template").unwrap(), "", "")
        .unwrap();
    let prompt = tmpl.render(&messages, true).unwrap();
    assert_eq!(prompt, chat["prompt"].as_str().unwrap());
    assert_eq!(tok.encode(&prompt, true, true), ids(&chat["prompt_ids"]));
}

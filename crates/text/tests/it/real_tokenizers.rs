//! The tokenizers and chat templates of the real Qwen2.5-Coder and Gemma 3 files agree with
//! llama.cpp: every reference string's ids in both special modes, every greedy entry's prompt
//! ids, and every chat entry's templated prompt, character for character.

use serde_json::Value;
use text::{ChatMessage, ChatTemplate, Tokenizer};

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn real_tokenizers_and_templates_match_llama_cpp() {
    let mut failures = Vec::new();
    for (name, reference) in testkit::REAL_MODELS {
        let f = gguf::GgufFile::open(testkit::named_model(name)).unwrap();
        let tok = Tokenizer::from_header(f.header()).unwrap();
        let template = ChatTemplate::from_header(f.header(), &tok).unwrap();
        let r: Value = serde_json::from_str(&testkit::reference_text(reference)).unwrap();
        for e in r["tokenizer"].as_array().unwrap() {
            let text = e["text"].as_str().unwrap();
            for (parse, key) in [(false, "ids"), (true, "ids_parse_special")] {
                let got = tok.encode(text, false, parse);
                if got != ids(&e[key]) {
                    failures.push(format!(
                        "{name} tokenizer {} (parse_special={parse}): got {got:?}, want {:?}",
                        e["name"], e[key]
                    ));
                }
            }
        }
        for g in r["greedy"].as_array().unwrap() {
            let prompt = g["prompt"].as_str().unwrap();
            let want = ids(&g["prompt_ids"]);
            if let Some(messages) = g.get("messages") {
                let messages: Vec<ChatMessage> = serde_json::from_value(messages.clone()).unwrap();
                let t = template
                    .as_ref()
                    .expect("a chat entry's model has a template");
                let rendered = t.render(&messages, true).unwrap();
                if rendered != prompt {
                    failures.push(format!(
                        "{name} {}: template gave {rendered:?}, want {prompt:?}",
                        g["name"]
                    ));
                }
                let got = tok.encode_chat(t, &messages).unwrap();
                if got != want {
                    failures.push(format!(
                        "{name} {}: chat ids {got:?}, want {want:?}",
                        g["name"]
                    ));
                }
            }
            let got = tok.encode(prompt, true, true);
            if got != want {
                failures.push(format!(
                    "{name} {}: prompt ids {got:?}, want {want:?}",
                    g["name"]
                ));
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

/// Qwen2.5's template prints offered tools, an assistant's tool calls and a tool's answer in
/// its Hermes format: what the model was trained to read (and what the tracker parses back).
#[test]
fn qwen_renders_tools_tool_calls_and_tool_results() {
    let f = gguf::GgufFile::open(testkit::named_model("qwen2.5-coder-0.5b")).unwrap();
    let tok = Tokenizer::from_header(f.header()).unwrap();
    let template = ChatTemplate::from_header(f.header(), &tok)
        .unwrap()
        .unwrap();
    assert!(template.has_hermes_tools());
    let tools: Value = serde_json::from_str(
        r#"[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]"#,
    )
    .unwrap();
    let call: Value = serde_json::from_str(
        r#"[{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]"#,
    )
    .unwrap();
    let messages = vec![
        ChatMessage::new("user", "Weather in Paris?"),
        ChatMessage {
            tool_calls: Some(call),
            ..ChatMessage::new("assistant", "")
        },
        ChatMessage {
            tool_call_id: Some("c1".into()),
            ..ChatMessage::new("tool", "{\"sky\": \"sunny\"}")
        },
    ];
    let text = template
        .render_vars(
            &messages,
            text::Vars {
                tools: Some(&tools),
                kwargs: None,
            },
            true,
        )
        .unwrap();
    for want in [
        "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\"",
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>",
        "<|im_start|>user\n<tool_response>\n{\"sky\": \"sunny\"}\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
    // The tool's answer is content: its text is never read as control tokens.
    let parts = template
        .render_parts(
            &messages,
            text::Vars {
                tools: Some(&tools),
                kwargs: None,
            },
            true,
        )
        .unwrap();
    assert_eq!(
        parts.text, text,
        "the marked rendering found every content where it is"
    );
    let sunny = text.find("{\"sky\"").unwrap();
    assert!(parts.content.iter().any(|r| r.contains(&sunny)));
}

/// A draft model must share its target's vocabulary: Qwen2.5-Coder 0.5B and 1.5B do; SmolLM2
/// and Gemma 3 do not, and the difference names what differs.
#[test]
fn vocabularies_compare_for_drafting() {
    let load = |name: &str| {
        let f = gguf::GgufFile::open(testkit::named_model(name)).unwrap();
        Tokenizer::from_header(f.header()).unwrap()
    };
    let (qwen_small, qwen) = (load("qwen2.5-coder-0.5b"), load("qwen2.5-coder-1.5b"));
    assert_eq!(qwen.difference(&qwen_small), None);
    assert_eq!(qwen.difference(&qwen), None);
    let smol = load("smollm2-135m");
    let gemma = load("gemma3-270m");
    let why = smol.difference(&gemma).expect("SmolLM2 and Gemma 3 differ");
    assert!(why.contains("tokenizer models differ"), "{why}");
    let why = qwen.difference(&smol).expect("Qwen and SmolLM2 differ");
    assert!(why.contains("49152") && why.contains("151"), "{why}");
}

//! The Responses and Messages APIs over real sockets, against trackers in this process (tiny
//! models, in-memory shards): each is the chat session rendered another way (the same
//! tokens as chat completions for the same conversation), with its documented event
//! sequence; stored responses continue with `previous_response_id`; tools on a template
//! without a tool format; a template's thinking section split out as reasoning; stop
//! sequences, output cut to the context, typed errors in each API's shape.
//! (The real clients, on Qwen2.5-Coder, are `tests/agents/`, run by `.ci/run`.)

use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use testkit::http::{post_json, request, SseStream};

struct Node {
    addr: String,
    _rt: tokio::runtime::Runtime,
}

fn start(spec: testkit::TinySpec, name: &str, config: tracker::TrackerConfig) -> Node {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut sc = shard::ShardConfig::in_process(testkit::write_tiny_model(&spec, name));
    sc.n_ctx = 4096;
    let core = shard::ShardCore::load(sc).unwrap();
    let routes = vec![tracker::RouteSpec {
        name: "local".into(),
        shards: vec![Arc::new(shard::LocalShard::new(core))],
    }];
    let addr = rt.block_on(async {
        let t = tracker::Tracker::start(config, routes).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(t.serve(listener, std::future::pending()));
        addr
    });
    Node { addr, _rt: rt }
}

fn config() -> tracker::TrackerConfig {
    tracker::TrackerConfig {
        health_period: Duration::from_millis(50),
        ..tracker::TrackerConfig::default()
    }
}

fn tiny() -> Node {
    start(testkit::TinySpec::default(), "agent-endpoints", config())
}

/// Chat completions' answer to `messages` (greedy): the text every other API must give.
fn chat_text(addr: &str, messages: Value, max_tokens: u32) -> String {
    let r = post_json(
        addr,
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

/// Every event of a stream, as JSON.
fn events(addr: &str, path: &str, body: &Value) -> Vec<Value> {
    let mut s = SseStream::open(addr, path, body).unwrap();
    assert_eq!(s.status, 200);
    let mut out = Vec::new();
    while let Some(d) = s.next_data() {
        out.push(serde_json::from_str(&d).unwrap_or_else(|e| panic!("{e}: {d}")));
    }
    out
}

fn types(evs: &[Value]) -> Vec<String> {
    evs.iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn a_response_is_the_chat_answer_as_output_items_whole_and_streamed() {
    let n = tiny();
    let a = &n.addr;
    let msgs = json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the weather"}]);
    let want = chat_text(a, msgs.clone(), 12);
    let body = json!({"instructions": "be brief", "input": "the weather", "max_output_tokens": 12, "temperature": 0});
    let r = post_json(a, "/v1/responses", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["object"], "response");
    assert_eq!(
        v["status"], "incomplete",
        "12 tokens of a random model: cut"
    );
    assert_eq!(v["incomplete_details"]["reason"], "max_output_tokens");
    assert_eq!(v["output"][0]["type"], "message");
    assert_eq!(v["output"][0]["content"][0]["text"], json!(want));
    assert_eq!(v["usage"]["output_tokens"], 12);
    assert_eq!(v["instructions"], "be brief");

    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let evs = events(a, "/v1/responses", &stream_body);
    let t = types(&evs);
    assert_eq!(
        &t[..5],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta"
        ]
    );
    let tail: Vec<&str> = t[t.len() - 4..].iter().map(String::as_str).collect();
    assert_eq!(
        tail,
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete"
        ]
    );
    let deltas: String = evs
        .iter()
        .filter(|e| e["type"] == "response.output_text.delta")
        .map(|e| e["delta"].as_str().unwrap())
        .collect();
    assert_eq!(deltas, want);
    let seqs: Vec<u64> = evs
        .iter()
        .map(|e| e["sequence_number"].as_u64().unwrap())
        .collect();
    assert!(seqs.windows(2).all(|w| w[1] == w[0] + 1), "{seqs:?}");
    assert_eq!(
        evs.last().unwrap()["response"]["output"][0]["content"][0]["text"],
        json!(want)
    );
}

#[test]
fn a_stored_response_continues_with_previous_response_id() {
    let n = tiny();
    let a = &n.addr;
    let first = post_json(
        a,
        "/v1/responses",
        &json!({"input": "the weather", "max_output_tokens": 6, "temperature": 0}),
    );
    assert_eq!(first.status, 200, "{}", first.body);
    let first = first.json();
    let said = first["output"][0]["content"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let id = first["id"].as_str().unwrap();
    let next = post_json(
        a,
        "/v1/responses",
        &json!({"input": [{"role": "user", "content": "and tomorrow"}], "previous_response_id": id, "max_output_tokens": 6, "temperature": 0}),
    );
    assert_eq!(next.status, 200, "{}", next.body);
    // The same answer as chat completions given the whole conversation.
    let want = chat_text(
        a,
        json!([{"role": "user", "content": "the weather"}, {"role": "assistant", "content": said}, {"role": "user", "content": "and tomorrow"}]),
        6,
    );
    assert_eq!(next.json()["output"][0]["content"][0]["text"], json!(want));
    // Retrieved, deleted, then gone; an unknown id is a typed 404.
    let got = request("GET", a, &format!("/v1/responses/{id}"), None, &[]).unwrap();
    assert_eq!((got.status, got.json()["id"].as_str()), (200, Some(id)));
    let del = request("DELETE", a, &format!("/v1/responses/{id}"), None, &[]).unwrap();
    assert_eq!(del.status, 200);
    let gone = post_json(
        a,
        "/v1/responses",
        &json!({"input": "x", "previous_response_id": id}),
    );
    assert_eq!(gone.status, 404, "{}", gone.body);
    assert_eq!(gone.json()["error"]["param"], "previous_response_id");
    // `store: false` keeps nothing.
    let unstored = post_json(
        a,
        "/v1/responses",
        &json!({"input": "x", "max_output_tokens": 2, "store": false}),
    )
    .json();
    let uid = unstored["id"].as_str().unwrap();
    assert_eq!(
        request("GET", a, &format!("/v1/responses/{uid}"), None, &[])
            .unwrap()
            .status,
        404
    );
}

#[test]
fn a_message_is_the_chat_answer_as_content_blocks_whole_and_streamed() {
    let n = tiny();
    let a = &n.addr;
    let want = chat_text(
        a,
        json!([{"role": "system", "content": "be brief"}, {"role": "user", "content": "the weather"}]),
        10,
    );
    let body = json!({"system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
                      "messages": [{"role": "user", "content": [{"type": "text", "text": "the weather"}]}],
                      "max_tokens": 10, "temperature": 0, "metadata": {"user_id": "u"}});
    let r = post_json(a, "/v1/messages", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(
        (v["type"].as_str(), v["role"].as_str()),
        (Some("message"), Some("assistant"))
    );
    assert_eq!(v["content"][0], json!({"type": "text", "text": want}));
    assert_eq!(v["stop_reason"], "max_tokens");
    // As Anthropic counts: the prompt is the input tokens and those read from the cache (the
    // chat request above computed the same prompt and generated past it, so every position
    // but the last, which must be computed to sample, comes from the cache).
    let counted = post_json(a, "/v1/messages/count_tokens", &body).json();
    let (input, cached) = (
        v["usage"]["input_tokens"].as_u64().unwrap(),
        v["usage"]["cache_read_input_tokens"].as_u64().unwrap(),
    );
    assert_eq!(
        counted["input_tokens"],
        json!(input + cached),
        "{}",
        v["usage"]
    );
    assert_eq!(input, 1, "{}", v["usage"]);

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let evs = events(a, "/v1/messages", &sb);
    let t = types(&evs);
    assert_eq!(&t[..3], ["message_start", "ping", "content_block_start"]);
    assert_eq!(
        &t[t.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    let text: String = evs
        .iter()
        .filter(|e| e["type"] == "content_block_delta")
        .map(|e| e["delta"]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, want);
    assert_eq!(evs[t.len() - 2]["delta"]["stop_reason"], "max_tokens");
    // The stream starts before the cache is looked at: its start counts the whole prompt as
    // input, and its end says what came from the cache, as the whole answer does.
    assert_eq!(
        evs[0]["message"]["usage"]["input_tokens"],
        json!(input + cached)
    );
    let end = &evs[t.len() - 2]["usage"];
    assert_eq!(
        (&end["input_tokens"], &end["cache_read_input_tokens"]),
        (
            &v["usage"]["input_tokens"],
            &v["usage"]["cache_read_input_tokens"]
        ),
        "{end}"
    );
}

#[test]
fn a_stop_sequence_and_an_output_over_the_context_say_how_the_message_ended() {
    // This seed's model answers blank lines, then a run of one letter: a stop sequence
    // across the two is in the middle of the answer.
    let n = start(
        testkit::TinySpec {
            seed: 6,
            ..testkit::TinySpec::default()
        },
        "agent-endpoints-stops",
        config(),
    );
    let a = &n.addr;
    let msgs = json!([{"role": "user", "content": "the weather"}]);
    let r = post_json(
        a,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 24, "temperature": 1, "seed": 7}),
    );
    let text = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // A stop sequence from the middle of the greedy answer ends it there, and is named.
    let at = text
        .find(|c: char| !c.is_whitespace())
        .expect("a letter after the blank lines");
    let stop = text[at - 1..at + 1].to_string();
    let r = post_json(a, "/v1/messages", &json!({"messages": msgs, "max_tokens": 24, "temperature": 1, "seed": 7, "stop_sequences": [stop]})).json();
    assert_eq!(r["stop_reason"], "stop_sequence", "{r}");
    assert_eq!(r["stop_sequence"], json!(stop));
    assert_eq!(
        r["content"][0]["text"],
        json!(text[..text.find(&stop).unwrap()])
    );
    // Claude Code asks for 32000 tokens of a 4096-position context: cut to what is left.
    let r = post_json(
        a,
        "/v1/messages",
        &json!({"messages": msgs, "max_tokens": 32000, "temperature": 1, "seed": 7, "stop_sequences": [stop]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    // Chat completions refuse the same, as OpenAI does.
    let r = post_json(
        a,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 32000}),
    );
    assert_eq!(r.status, 400, "{}", r.body);
}

#[test]
fn errors_come_in_each_api_s_shape() {
    let n = start(
        testkit::TinySpec::default(),
        "agent-endpoints-keys",
        tracker::TrackerConfig {
            api_key: Some("sekrit-key".into()),
            ..config()
        },
    );
    let a = &n.addr;
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let r = post_json(a, "/v1/messages", &body);
    assert_eq!(r.status, 401);
    let v = r.json();
    assert_eq!(
        (v["type"].as_str(), v["error"]["type"].as_str()),
        (Some("error"), Some("authentication_error"))
    );
    // Anthropic's clients send the key as `x-api-key`.
    let r = request(
        "POST",
        a,
        "/v1/messages",
        Some(&body),
        &[("x-api-key", "sekrit-key")],
    )
    .unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let r = request("POST", a, "/v1/messages", Some(&json!({"messages": [{"role": "user", "content": [{"type": "image"}]}], "max_tokens": 2})), &[("x-api-key", "sekrit-key")]).unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    assert_eq!(r.json()["error"]["param"], "messages[0].content[0].type");
    // The Responses API answers in OpenAI's shape.
    let r = request(
        "POST",
        a,
        "/v1/responses",
        Some(&json!({"input": "x", "background": true})),
        &[("authorization", "Bearer sekrit-key")],
    )
    .unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "background");
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn tools_on_a_template_without_a_tool_format_are_shown_and_their_calls_held() {
    let n = tiny();
    let a = &n.addr;
    let tool = json!({"name": "pick", "description": "picks a color", "input_schema": {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"], "additionalProperties": false}});
    for parallel_off in [false, true] {
        let r = post_json(
            a,
            "/v1/messages",
            &json!({"messages": [{"role": "user", "content": "pick one"}], "max_tokens": 200, "temperature": 0,
                    "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": parallel_off}}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        // A random model rarely ends a list of calls it may go on with; one call ends.
        if parallel_off {
            assert_eq!(v["stop_reason"], "tool_use", "{v}");
        }
        let calls: Vec<&Value> = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert!(!calls.is_empty());
        if parallel_off {
            assert_eq!(calls.len(), 1, "one call only: {v}");
        }
        for c in calls {
            assert_eq!(c["name"], "pick");
            assert!(
                ["red", "blue"].contains(&c["input"]["color"].as_str().unwrap()),
                "{c}"
            );
        }
    }
    // The same through the Responses API and chat completions.
    let r = post_json(
        a,
        "/v1/responses",
        &json!({"input": "pick one", "max_output_tokens": 200, "temperature": 0, "tool_choice": "required", "parallel_tool_calls": false,
                "tools": [{"type": "function", "name": "pick", "parameters": tool["input_schema"], "strict": true}]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let out = r.json()["output"].clone();
    let calls: Vec<&Value> = out
        .as_array()
        .unwrap()
        .iter()
        .filter(|i| i["type"] == "function_call")
        .collect();
    assert_eq!(calls.len(), 1, "{out}");
    let args: Value = serde_json::from_str(calls[0]["arguments"].as_str().unwrap()).unwrap();
    assert!(["red", "blue"].contains(&args["color"].as_str().unwrap()));
    assert!(calls[0]["call_id"].as_str().unwrap().starts_with("call_"));
}

#[test]
fn a_template_that_writes_calls_as_json_objects_gets_its_calls_in_that_format() {
    let spec = testkit::TinySpec {
        chat_template: testkit::CHATML_JSON_TOOLS,
        ..testkit::TinySpec::default()
    };
    let n = start(spec, "agent-endpoints-json-tools", config());
    let a = &n.addr;
    let tool = json!({"name": "pick", "description": "picks a color", "input_schema": {"type": "object", "properties": {"color": {"enum": ["red", "blue"]}}, "required": ["color"], "additionalProperties": false}});
    let r = post_json(
        a,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "pick one"}], "max_tokens": 200, "temperature": 0,
                "tools": [tool], "tool_choice": {"type": "any", "disable_parallel_tool_use": true}}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let v = r.json();
    assert_eq!(v["stop_reason"], "tool_use", "{v}");
    assert_eq!(v["content"][0]["type"], "tool_use", "{v}");
    assert!(
        ["red", "blue"].contains(&v["content"][0]["input"]["color"].as_str().unwrap()),
        "{v}"
    );
    // The call and its result go back through the template's own format.
    let call = v["content"][0].clone();
    let r = post_json(
        a,
        "/v1/messages",
        &json!({"messages": [{"role": "user", "content": "pick one"},
                             {"role": "assistant", "content": [call]},
                             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": "done"}]}],
                "max_tokens": 4, "temperature": 0, "tools": [tool]}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
}

#[test]
fn a_template_s_thinking_section_is_split_out_as_reasoning() {
    let spec = testkit::TinySpec {
        arch: "qwen3",
        seed: 6,
        chat_template: testkit::CHATML_THINKING,
        ..testkit::TinySpec::default()
    };
    let n = start(spec, "agent-endpoints-qwen3", config());
    let a = &n.addr;
    // The prompts the template renders, thinking on (it opens the section) and off.
    let on = "<|im_start|>user\nthe weather<|im_end|>\n<|im_start|>assistant\n<think>\n";
    let off =
        "<|im_start|>user\nthe weather<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";
    let completion = |prompt: &str| -> String {
        // Token 13 is the newline byte, which this random model would otherwise repeat.
        let r = post_json(
            a,
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 10, "temperature": 1, "seed": 3, "logit_bias": {"13": -100}}),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let (thought, plain) = (completion(on), completion(off));
    assert!(
        !thought.contains("</think>"),
        "a random model never closes it: {thought:?}"
    );
    let msgs = json!([{"role": "user", "content": "the weather"}]);
    let chat = |extra: Value| -> Value {
        let mut b = json!({"messages": msgs, "max_tokens": 10, "temperature": 1, "seed": 3, "logit_bias": {"13": -100}});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        let r = post_json(a, "/v1/chat/completions", &b);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["message"].clone()
    };
    // On by default: every token is the thinking section's (the prompt opened it).
    let m = chat(json!({}));
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some(thought.as_str()), Some(""))
    );
    // Off (chat_template_kwargs, or an effort of `none`): the answer is plain content.
    for extra in [
        json!({"chat_template_kwargs": {"enable_thinking": false}}),
        json!({"reasoning_effort": "none"}),
    ] {
        let m = chat(extra);
        assert_eq!(m["content"].as_str(), Some(plain.as_str()));
        assert!(m.get("reasoning_content").is_none(), "{m}");
    }
    // The Messages API gives a thinking block; disabled, none.
    let r = post_json(
        a,
        "/v1/messages",
        &json!({"messages": msgs, "max_tokens": 10, "temperature": 1, "seed": 3}),
    )
    .json();
    assert_eq!(r["content"][0]["type"], "thinking", "{r}");
    let r = post_json(a, "/v1/messages", &json!({"messages": msgs, "max_tokens": 10, "temperature": 1, "seed": 3, "thinking": {"type": "disabled"}})).json();
    assert_eq!(r["content"][0]["type"], "text", "{r}");
    // The Responses API a reasoning item, with its tokens counted.
    let r = post_json(
        a,
        "/v1/responses",
        &json!({"input": "the weather", "max_output_tokens": 10, "temperature": 1, "seed": 3}),
    )
    .json();
    assert_eq!(r["output"][0]["type"], "reasoning", "{r}");
    assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 10);
    // A template variable strata sets itself cannot be replaced.
    let r = post_json(
        a,
        "/v1/chat/completions",
        &json!({"messages": msgs, "max_tokens": 2, "chat_template_kwargs": {"messages": []}}),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["param"], "chat_template_kwargs.messages");
}

#[test]
fn the_readme_lists_every_field_accepted_without_effect() {
    let readme = std::fs::read_to_string(testkit::repo_root().join("README.md")).unwrap();
    let table = &readme[readme
        .find("Fields accepted without effect")
        .expect("the section")..];
    for (field, _) in tracker::NO_EFFECT {
        for f in field.split(", ") {
            assert!(
                table.contains(&format!("`{f}`")),
                "README does not list `{f}`"
            );
        }
    }
}

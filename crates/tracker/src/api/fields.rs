//! Reading a request body's fields: typed readers whose refusals name the field, and the one
//! list of fields that change nothing about what is generated (accepted so that clients
//! which send them on every request work, and documented in the README as such).
//!
//! Every other field an endpoint takes does what it says or is refused with a 400 naming it.

use engine::Refusal;
use serde_json::Value;

/// `metadata`, where a request carries it, as OpenAI bounds it: an object of at most 16
/// string values, keys of at most 64 characters, values of at most 512. The Responses API
/// echoes it into the response it stores: unbounded, it would be memory any caller fills.
pub fn metadata(body: &Value) -> Result<(), Refusal> {
    let Some(m) = body.get("metadata").filter(|v| !v.is_null()) else {
        return Ok(());
    };
    let Some(m) = m.as_object() else {
        return Err(Refusal::invalid(
            "metadata",
            "`metadata` must be an object of string values",
        ));
    };
    if m.len() > 16 {
        return Err(Refusal::invalid(
            "metadata",
            format!("`metadata` has {} keys: at most 16", m.len()),
        ));
    }
    for (k, v) in m {
        if k.chars().count() > 64 {
            return Err(Refusal::invalid(
                "metadata",
                "a `metadata` key is longer than 64 characters",
            ));
        }
        match v.as_str() {
            Some(v) if v.chars().count() <= 512 => {}
            Some(_) => {
                return Err(Refusal::invalid(
                    "metadata",
                    "a `metadata` value is longer than 512 characters",
                ))
            }
            None => {
                return Err(Refusal::invalid(
                    "metadata",
                    "`metadata` values must be strings",
                ))
            }
        }
    }
    Ok(())
}

/// Longest `prompt_cache_key` or `cache_salt` accepted, in bytes.
pub const MAX_CACHE_KEY_BYTES: usize = 1024;

/// The prefix-cache group a request names: OpenAI's `prompt_cache_key` and vLLM's
/// `cache_salt`, each a non-empty string of at most [`MAX_CACHE_KEY_BYTES`]. Requests share
/// cached prompt blocks only when they name the same group (and, under the default
/// `--prefix-cache-scope key`, hold the same API key): a caller narrows its partition, it
/// never widens it. `None` when it names neither.
pub fn cache_group(body: &Value) -> Result<Option<String>, Refusal> {
    let mut parts = Vec::new();
    for field in ["prompt_cache_key", "cache_salt"] {
        match body.get(field) {
            None | Some(Value::Null) => parts.push(Value::Null),
            Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_CACHE_KEY_BYTES => {
                parts.push(Value::String(s.clone()))
            }
            Some(_) => {
                return Err(Refusal::invalid(
                    field,
                    format!(
                    "`{field}` must be a non-empty string of at most {MAX_CACHE_KEY_BYTES} bytes"
                ),
                ))
            }
        }
    }
    // The pair as JSON: unambiguous, so no two pairs name one group.
    Ok(parts
        .iter()
        .any(|p| !p.is_null())
        .then(|| Value::Array(parts).to_string()))
}

/// Fields that change nothing about generation, by endpoint, with why each is safe to take.
/// This is the list the README's "Fields accepted without effect" section shows.
pub const NO_EFFECT: &[(&str, &str)] = &[
    ("metadata", "a label the caller keeps with its request; echoed back by /v1/responses"),
    ("store", "chat: whether OpenAI keeps the completion for its dashboard"),
    ("service_tier", "a billing tier; strata has one"),
    ("prompt_cache_retention", "strata's prefix cache keeps blocks while there is room"),
    ("safety_identifier", "an end-user id for OpenAI's abuse checks"),
    ("client_metadata", "Codex's description of its session"),
    ("include", "/v1/responses: reasoning is returned as text, never encrypted; `message.output_text.logprobs` is honoured"),
    ("truncation", "/v1/responses: only `disabled` (the default) is accepted: a prompt over the context is refused"),
    ("background", "/v1/responses: only `false` is accepted"),
    ("stream_options.include_obfuscation", "/v1/responses: padding OpenAI adds to stream events"),
    ("reasoning.summary", "/v1/responses: strata returns the reasoning itself, not a summary"),
    ("cache_control", "/v1/messages: prompt caching is automatic (the prefix cache)"),
    ("context_management", "/v1/messages: edits of earlier thinking blocks; templates drop earlier turns' thinking"),
    ("output_config.effort", "/v1/messages: an effort level for Anthropic's models"),
    ("thinking, reasoning_effort, reasoning.effort", "on a model whose template has no thinking section: it never thinks; on one that has, they turn thinking on or off (`thinking.budget_tokens` is not enforced apart from `max_tokens`)"),
];

/// A number in `[min, max]`, or `None` when absent or null.
pub fn number(body: &Value, key: &str, min: f64, max: f64) -> Result<Option<f64>, Refusal> {
    number_at(body.get(key), key, min, max)
}

/// [`number`] of a value found at `param`.
pub fn number_at(
    v: Option<&Value>,
    param: &str,
    min: f64,
    max: f64,
) -> Result<Option<f64>, Refusal> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let x = v.as_f64().ok_or_else(|| {
                Refusal::invalid(param, format!("`{param}` must be a number, got {v}"))
            })?;
            if !(min..=max).contains(&x) {
                return Err(Refusal::invalid(
                    param,
                    format!("`{param}` is {x} but must be between {min} and {max}"),
                ));
            }
            Ok(Some(x))
        }
    }
}

/// A whole number in `[min, max]`, or `None` when absent or null.
pub fn integer(body: &Value, key: &str, min: u64, max: u64) -> Result<Option<u64>, Refusal> {
    integer_at(body.get(key), key, min, max)
}

/// [`integer`] of a value found at `param`.
pub fn integer_at(
    v: Option<&Value>,
    param: &str,
    min: u64,
    max: u64,
) -> Result<Option<u64>, Refusal> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let x = v.as_u64().ok_or_else(|| {
                Refusal::invalid(
                    param,
                    format!("`{param}` must be a non-negative integer, got {v}"),
                )
            })?;
            if !(min..=max).contains(&x) {
                return Err(Refusal::invalid(
                    param,
                    format!("`{param}` is {x} but must be between {min} and {max}"),
                ));
            }
            Ok(Some(x))
        }
    }
}

/// A string, or `None` when absent or null.
pub fn string(body: &Value, key: &str) -> Result<Option<String>, Refusal> {
    string_at(body.get(key), key)
}

/// [`string`] of a value found at `param`.
pub fn string_at(v: Option<&Value>, param: &str) -> Result<Option<String>, Refusal> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(Refusal::invalid(
            param,
            format!("`{param}` must be a string, got {v}"),
        )),
    }
}

/// A boolean, or `None` when absent or null.
pub fn boolean(body: &Value, key: &str) -> Result<Option<bool>, Refusal> {
    boolean_at(body.get(key), key)
}

/// [`boolean`] of a value found at `param`.
pub fn boolean_at(v: Option<&Value>, param: &str) -> Result<Option<bool>, Refusal> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(Refusal::invalid(
            param,
            format!("`{param}` must be a boolean, got {v}"),
        )),
    }
}

/// Refuses the first key of `obj` outside `allowed`, naming it under `prefix` (`""` for the
/// body itself) and saying where it was sent.
pub fn only(obj: &Value, prefix: &str, allowed: &[&str], place: &str) -> Result<(), Refusal> {
    let Some(o) = obj.as_object() else {
        return Ok(());
    };
    match o.keys().find(|k| !allowed.contains(&k.as_str())) {
        None => Ok(()),
        Some(k) => {
            let param = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            Err(Refusal::invalid(
                &param,
                format!("`{param}` is not supported on {place}"),
            ))
        }
    }
}

/// Takes only the value `accepted` (or absence) at `param`: a field on the no-effect list
/// whose other values would change something strata does not do.
pub fn only_value(v: Option<&Value>, param: &str, accepted: &Value) -> Result<(), Refusal> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(x) if x == accepted => Ok(()),
        Some(x) => Err(Refusal::invalid(
            param,
            format!("`{param}` is {x}; only {accepted} is supported"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn readers_name_the_field_and_the_bounds() {
        let body = json!({"t": 3, "s": 1, "b": "x", "n": null});
        let e = number(&body, "t", 0.0, 2.0).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("t"));
        assert!(e.message.contains("between 0 and 2"), "{}", e.message);
        assert_eq!(string(&body, "s").unwrap_err().param.as_deref(), Some("s"));
        assert_eq!(boolean(&body, "b").unwrap_err().param.as_deref(), Some("b"));
        assert_eq!(integer(&body, "n", 0, 1).unwrap(), None);
        let e = only(&json!({"a": 1, "zz": 2}), "x", &["a"], "/p").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("x.zz"));
        assert!(only_value(Some(&json!(true)), "background", &json!(false)).is_err());
        assert!(only_value(Some(&json!(false)), "background", &json!(false)).is_ok());
    }

    #[test]
    fn a_cache_group_is_named_by_both_fields_and_bounded() {
        assert_eq!(cache_group(&json!({})).unwrap(), None);
        assert_eq!(cache_group(&json!({"cache_salt": null})).unwrap(), None);
        let k = cache_group(&json!({"prompt_cache_key": "a"})).unwrap();
        let s = cache_group(&json!({"cache_salt": "a"})).unwrap();
        let both = cache_group(&json!({"prompt_cache_key": "a", "cache_salt": "a"})).unwrap();
        assert!(k.is_some() && s.is_some() && both.is_some());
        assert!(k != s && k != both && s != both, "each pair its own group");
        for bad in [
            json!(""),
            json!(5),
            json!("x".repeat(MAX_CACHE_KEY_BYTES + 1)),
        ] {
            for field in ["prompt_cache_key", "cache_salt"] {
                let e = cache_group(&json!({ field: bad.clone() })).unwrap_err();
                assert_eq!(e.param.as_deref(), Some(field));
            }
        }
        let at_limit = "x".repeat(MAX_CACHE_KEY_BYTES);
        assert!(cache_group(&json!({ "cache_salt": at_limit })).is_ok());
    }
}

//! The caller's credentials as the API reads them, checked before anything else.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::middleware::Next;
use axum::response::Response;

use super::error::Answer;
use super::state::AppState;

/// The key comes first: a request to any endpoint that needs one is refused from its headers
/// alone, before its body is read, parsed or validated and before its model is resolved, so
/// an unauthenticated caller learns nothing of the cluster (no model list, no validation
/// message) and costs no more than its headers. The handlers check the key again where they
/// need its identity. Open: the probes (`/livez`, `/readyz`) and the console's static files
/// (the page asks for the key itself); `/health` and `/metrics` as `--public-metrics` says;
/// `/admin/...` under the operator's own token, which its handler checks.
pub async fn key_first(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let checked = match path {
        "/livez"
        | "/readyz"
        | "/"
        | "/console"
        | "/console/console.js"
        | "/console/console.css" => Ok(()),
        "/health" | "/metrics" => s.may_observe(req.headers()),
        _ if path.starts_with("/admin/") => Ok(()),
        _ => s.key(req.headers()).map(|_| ()),
    };
    match checked {
        Ok(()) => next.run(req).await,
        // The Messages API's clients read Anthropic's error shape.
        Err(refusal) if path.starts_with("/v1/messages") => super::error::anthropic(&refusal),
        Err(refusal) => refusal.into_response(),
    }
}

/// The secret from `Authorization: Bearer <key>`, else from `x-api-key` (how Anthropic's
/// clients send it), "" when there is none.
pub fn bearer(headers: &HeaderMap) -> String {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
        .or_else(|| {
            headers
                .get("x-api-key")
                .and_then(|v| v.to_str().ok())
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        })
        .unwrap_or_default()
}

/// The token of an `Authorization` value in the Bearer scheme, whose name is
/// case-insensitive (RFC 7235): `Bearer k`, `bearer k` and `BEARER k` all carry `k`.
fn bearer_token(value: &str) -> Option<String> {
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim().to_string())
        .filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::{bearer, bearer_token};

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k1", "bearer k1", "BEARER  k1 ", "  bEaReR k1"] {
            assert_eq!(bearer_token(v).as_deref(), Some("k1"), "{v:?}");
        }
        for v in ["Basic k1", "Bearerk1", "Bearer ", "k1", ""] {
            assert_eq!(bearer_token(v), None, "{v:?}");
        }
    }

    #[test]
    fn an_anthropic_client_s_x_api_key_is_read() {
        let mut h = axum::http::HeaderMap::new();
        h.insert("x-api-key", "k2".parse().unwrap());
        assert_eq!(bearer(&h), "k2");
        h.insert("authorization", "Bearer k1".parse().unwrap());
        assert_eq!(bearer(&h), "k1", "the Authorization header comes first");
    }
}

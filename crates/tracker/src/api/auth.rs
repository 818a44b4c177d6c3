//! The caller's credentials as the API reads them.

use axum::http::HeaderMap;

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

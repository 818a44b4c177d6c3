//! The caller's credentials as the API reads them.

use axum::http::HeaderMap;

/// The secret from `Authorization: Bearer <key>` ("" when there is none).
pub fn bearer(headers: &HeaderMap) -> String {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token)
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
    use super::bearer_token;

    #[test]
    fn the_bearer_scheme_is_case_insensitive() {
        for v in ["Bearer k1", "bearer k1", "BEARER  k1 ", "  bEaReR k1"] {
            assert_eq!(bearer_token(v).as_deref(), Some("k1"), "{v:?}");
        }
        for v in ["Basic k1", "Bearerk1", "Bearer ", "k1", ""] {
            assert_eq!(bearer_token(v), None, "{v:?}");
        }
    }
}

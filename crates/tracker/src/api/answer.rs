//! An answer as clients see its parts: reasoning (a template's thinking section), text, and
//! tool calls, split out of the generated text as it streams. Chat completions, the Responses
//! API and the Messages API render the same parts; only the rendering differs.
//!
//! Both splitters are linear in the answer: each byte is looked at a bounded number of times,
//! and what is held back is bounded (a possible tag, a run of newlines before a call, or a
//! call's body, which the grammar bounds).

use constrain::grammar::CallFormat;
use serde_json::{json, Value};

/// One part of an answer, as it becomes known.
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Text of the thinking section (Qwen3's `<think>...</think>`).
    Reasoning(String),
    Text(String),
    /// A whole tool call.
    Call(ToolCall),
}

/// Where an answer's thinking section starts, for a template that has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// The answer may open with `<think>`.
    MayOpen,
    /// The prompt ended inside the section (the template opened it): the answer starts in it.
    Inside,
}

/// What an answer is split into: the thinking section (when the template has one and it is
/// on) and tool calls (when tools are offered).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Shape {
    pub thinking: Option<Thinking>,
    /// The offered tools' names, when the answer is searched for calls.
    pub tools: Option<std::sync::Arc<[String]>>,
    /// How the model writes its calls.
    pub tool_format: CallFormat,
}

impl Shape {
    /// Whether anything is split out: otherwise the text passes as it is, token by token.
    pub fn splits(&self) -> bool {
        self.thinking.is_some() || self.tools.is_some()
    }
}

/// Splits one answer into its parts as it streams.
#[derive(Debug)]
pub struct Splitter {
    think: Option<ThinkSplit>,
    tools: Option<CallFinder>,
}

impl Splitter {
    pub fn new(shape: &Shape) -> Self {
        Splitter {
            think: shape.thinking.map(ThinkSplit::new),
            tools: shape.tools.as_ref().map(|names| CallFinder {
                bare: Some(BareStart::new(names, shape.tool_format)),
                stream: ToolStream::default(),
            }),
        }
    }

    /// Whether the answer is inside its thinking section now.
    pub fn thinking(&self) -> bool {
        self.think
            .as_ref()
            .is_some_and(|t| t.state == ThinkState::Inside)
    }

    pub fn push(&mut self, text: &str) -> Vec<Part> {
        let parts = match &mut self.think {
            Some(t) => t.push(text),
            None => vec![Part::Text(text.to_string())],
        };
        self.calls(parts)
    }

    /// The end of the answer: whatever was held back.
    pub fn finish(&mut self) -> Vec<Part> {
        let mut parts = match &mut self.think {
            Some(t) => t.finish(),
            None => Vec::new(),
        };
        parts = self.calls(parts);
        if let Some(t) = &mut self.tools {
            parts.extend(t.finish().into_iter().map(Part::from));
        }
        parts
    }

    /// Text parts through the tool-call finder, when there is one.
    fn calls(&mut self, parts: Vec<Part>) -> Vec<Part> {
        let Some(tools) = &mut self.tools else {
            return parts.into_iter().filter(|p| !p.is_empty()).collect();
        };
        let mut out = Vec::with_capacity(parts.len());
        for p in parts {
            match p {
                Part::Text(t) => out.extend(tools.push(&t).into_iter().map(Part::from)),
                other => out.push(other),
            }
        }
        out.retain(|p| !p.is_empty());
        out
    }

    /// Splits a whole answer.
    pub fn split(shape: &Shape, text: &str) -> Answer {
        let mut s = Splitter::new(shape);
        let mut a = Answer::default();
        for p in s.push(text).into_iter().chain(s.finish()) {
            match p {
                Part::Reasoning(r) => a.reasoning.push_str(&r),
                Part::Text(t) => a.text.push_str(&t),
                Part::Call(c) => a.calls.push(c),
            }
        }
        a
    }
}

impl Part {
    fn is_empty(&self) -> bool {
        match self {
            Part::Reasoning(t) | Part::Text(t) => t.is_empty(),
            Part::Call(_) => false,
        }
    }
}

impl From<Piece> for Part {
    fn from(p: Piece) -> Part {
        match p {
            Piece::Text(t) => Part::Text(t),
            Piece::Call(c) => Part::Call(c),
        }
    }
}

/// A whole answer's parts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Answer {
    pub reasoning: String,
    pub text: String,
    pub calls: Vec<ToolCall>,
}

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
/// Most blank space held before an answer shows whether it opens its thinking section.
const MAX_LEADING_BLANK: usize = 64;

/// Splits off a thinking section at the start of an answer.
#[derive(Debug)]
struct ThinkSplit {
    state: ThinkState,
    /// Text not passed on yet: the answer's start (before it shows whether it opens the
    /// section), or a possible closing tag.
    held: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThinkState {
    /// Before the answer shows whether it opens the section.
    Start,
    Inside,
    /// Just after the section: the blank lines that follow it are layout.
    Closed,
    /// Plain text from here on.
    After,
}

impl ThinkSplit {
    fn new(start: Thinking) -> Self {
        ThinkSplit {
            state: match start {
                Thinking::MayOpen => ThinkState::Start,
                Thinking::Inside => ThinkState::Inside,
            },
            held: String::new(),
        }
    }

    fn push(&mut self, text: &str) -> Vec<Part> {
        let mut out = Vec::new();
        let mut text = text.to_string();
        loop {
            match self.state {
                ThinkState::Start => {
                    self.held.push_str(&text);
                    let lead = self.held.trim_start();
                    if lead.starts_with(THINK_OPEN) {
                        let rest = lead
                            .strip_prefix(THINK_OPEN)
                            .unwrap_or_default()
                            .to_string();
                        self.held.clear();
                        self.state = ThinkState::Inside;
                        text = rest;
                        continue;
                    }
                    // A long run of blank space before anything is text, not a wait.
                    let blank_run = self.held.len() > MAX_LEADING_BLANK;
                    if !THINK_OPEN.starts_with(lead) || blank_run {
                        out.push(Part::Text(std::mem::take(&mut self.held)));
                        self.state = ThinkState::After;
                    }
                    return out;
                }
                ThinkState::Inside => {
                    let from = self.held.len();
                    self.held.push_str(&text);
                    // Only the new text and a tag cut by the last push are searched.
                    let mut start = from.saturating_sub(THINK_CLOSE.len() - 1);
                    while !self.held.is_char_boundary(start) {
                        start -= 1;
                    }
                    if let Some(end) = self.held[start..].find(THINK_CLOSE).map(|e| e + start) {
                        let rest = self.held[end + THINK_CLOSE.len()..].to_string();
                        self.held.truncate(end);
                        out.push(Part::Reasoning(std::mem::take(&mut self.held)));
                        self.state = ThinkState::Closed;
                        text = rest;
                        continue;
                    }
                    let keep = (1..THINK_CLOSE.len())
                        .rev()
                        .find(|&k| self.held.ends_with(&THINK_CLOSE[..k]))
                        .unwrap_or(0);
                    let cut = self.held.len() - keep;
                    out.push(Part::Reasoning(self.held[..cut].to_string()));
                    self.held.drain(..cut);
                    return out;
                }
                ThinkState::Closed => {
                    let rest = text.trim_start();
                    if !rest.is_empty() {
                        self.state = ThinkState::After;
                        out.push(Part::Text(rest.to_string()));
                    }
                    return out;
                }
                ThinkState::After => {
                    out.push(Part::Text(text));
                    return out;
                }
            }
        }
    }

    fn finish(&mut self) -> Vec<Part> {
        let held = std::mem::take(&mut self.held);
        match self.state {
            // An answer that never closed its section thought to the end.
            ThinkState::Inside => vec![Part::Reasoning(held)],
            _ => vec![Part::Text(held)],
        }
    }
}

/// One tool call found in an answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as a JSON text (as OpenAI sends them).
    pub arguments: String,
}

impl ToolCall {
    pub fn json(&self, id: &str, index: usize) -> Value {
        json!({
            "index": index,
            "id": id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A call's body (between the tags): `{"name": ..., "arguments": ...}`, or `None`.
fn parse_call(body: &str) -> Option<ToolCall> {
    parse_call_of(body, CallFormat::Hermes)
}

/// A call's JSON object in `format`, its arguments under that format's key.
fn parse_call_of(body: &str, format: CallFormat) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get(format.arguments_key()) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// Finds the calls in an answer: a bare call at its start ([`BareStart`]), then calls in
/// `<tool_call>` tags ([`ToolStream`]).
#[derive(Debug)]
pub struct CallFinder {
    /// Until the answer's start shows whether it is a bare call.
    bare: Option<BareStart>,
    stream: ToolStream,
}

impl CallFinder {
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let Some(b) = &mut self.bare else {
            return self.stream.push(text);
        };
        let (mut out, rest) = b.push(text);
        if let Some(rest) = rest {
            self.bare = None;
            out.extend(self.stream.push(&rest));
        }
        out
    }

    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        if let Some(b) = self.bare.take() {
            let rest = match b.state {
                Bare::Closing => &b.held[closing(&b.held, true).unwrap_or(0)..],
                _ => &b.held[..],
            };
            out.extend(self.stream.push(rest));
        }
        out.extend(self.stream.finish());
        out
    }
}

/// Most blank bytes the grammar lets a bare call's layout have in one place.
const BARE_WS: usize = 8;

/// The start of an answer that may be a bare call, as Qwen2.5-Coder writes them: blank
/// space, an optional ```json fence, `{"name": "TOOL", "arguments": {...}}`, the closing
/// fence. The lazy tool grammar holds such a call once it names an offered tool, so this
/// reads exactly what the grammar admits. Bounded: what is held before the call is decided
/// is a few dozen bytes, and the call itself is the grammar's.
#[derive(Debug)]
struct BareStart {
    names: std::sync::Arc<[String]>,
    format: CallFormat,
    held: String,
    state: Bare,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bare {
    /// Not yet known whether the answer opens a bare call.
    Opening,
    /// Inside the call's JSON object, from byte `start` of what is held.
    Object {
        start: usize,
        at: usize,
        depth: usize,
        in_string: bool,
        escaped: bool,
    },
    /// After the object: a closing fence may follow.
    Closing,
}

/// How far `s` matches the opening of a bare call of one of `names`.
enum Opening {
    /// A prefix of an opening: wait for more.
    Maybe,
    /// A whole opening; the object starts at this byte.
    Is(usize),
    No,
}

fn bare_opening(s: &str, names: &[String]) -> Opening {
    let b = s.as_bytes();
    let mut i = 0;
    // Blank space (at most BARE_WS), then what must follow it, piece by piece.
    let blank = |i: &mut usize| {
        let start = *i;
        while *i < b.len() && *i - start < BARE_WS && matches!(b[*i], b' ' | b'\t' | b'\n') {
            *i += 1;
        }
    };
    // `lit` at `i`: Some(true) matched, Some(false) a prefix of it ends the text, None no.
    let lit = |i: &mut usize, lit: &str| -> Option<bool> {
        let rest = &b[*i..];
        if rest.len() >= lit.len() {
            if rest.starts_with(lit.as_bytes()) {
                *i += lit.len();
                return Some(true);
            }
            return None;
        }
        lit.as_bytes().starts_with(rest).then_some(false)
    };
    blank(&mut i);
    if i == b.len() {
        return Opening::Maybe;
    }
    if b[i] == b'`' {
        match lit(&mut i, "```") {
            Some(true) => {}
            Some(false) => return Opening::Maybe,
            None => return Opening::No,
        }
        if lit(&mut i, "json") == Some(false) {
            return Opening::Maybe;
        }
        match lit(&mut i, "\n") {
            Some(true) => {}
            Some(false) => return Opening::Maybe,
            None => return Opening::No,
        }
    }
    blank(&mut i);
    if i < b.len() && b[i] == b'<' {
        let mut open = None;
        for w in constrain::grammar::BARE_WRAPPERS {
            let mut j = i;
            match lit(&mut j, &format!("<{w}>")) {
                Some(true) => open = Some(j),
                Some(false) => return Opening::Maybe,
                None => {}
            }
        }
        match open {
            Some(j) => i = j,
            None => return Opening::No,
        }
    }
    let start = i;
    for piece in ["{", "\"name\"", ":", "\""] {
        blank(&mut i);
        if i == b.len() {
            return Opening::Maybe;
        }
        match lit(&mut i, piece) {
            Some(true) => {}
            Some(false) => return Opening::Maybe,
            None => return Opening::No,
        }
    }
    let name = &s[i..];
    for n in names.iter() {
        let quoted = format!("{n}\"");
        if name.starts_with(&quoted) {
            return Opening::Is(start);
        }
        if quoted.starts_with(name) {
            return Opening::Maybe;
        }
    }
    Opening::No
}

/// Where what follows a bare call's object starts, past the closing wrapper tag and fence
/// the grammar lets it have (`None`: `held` may still be the start of them, unless the
/// answer `ended`).
fn closing(held: &str, ended: bool) -> Option<usize> {
    let tags: Vec<String> = constrain::grammar::BARE_WRAPPERS
        .iter()
        .map(|w| format!("</{w}>"))
        .collect();
    let fence = ["```".to_string()];
    let mut at = 0;
    for lits in [&tags[..], &fence[..]] {
        let rest = &held[at..];
        let lead = rest.trim_start_matches([' ', '\t', '\n']);
        let blank = rest.len() - lead.len();
        if blank > BARE_WS {
            break;
        }
        if let Some(l) = lits.iter().find(|l| lead.starts_with(l.as_str())) {
            at += blank + l.len();
        } else if !ended && lits.iter().any(|l| l.starts_with(lead)) {
            return None;
        }
    }
    Some(at)
}

impl BareStart {
    fn new(names: &std::sync::Arc<[String]>, format: CallFormat) -> Self {
        BareStart {
            names: std::sync::Arc::clone(names),
            format,
            held: String::new(),
            state: Bare::Opening,
        }
    }

    /// Parts found, and once the start is settled, the text that follows (for the tagged
    /// calls' finder).
    fn push(&mut self, text: &str) -> (Vec<Piece>, Option<String>) {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            match self.state {
                Bare::Opening => match bare_opening(&self.held, &self.names) {
                    Opening::Maybe => return (out, None),
                    Opening::No => return (out, Some(std::mem::take(&mut self.held))),
                    Opening::Is(start) => {
                        self.state = Bare::Object {
                            start,
                            at: start,
                            depth: 0,
                            in_string: false,
                            escaped: false,
                        }
                    }
                },
                Bare::Object {
                    start,
                    mut at,
                    mut depth,
                    mut in_string,
                    mut escaped,
                } => {
                    let b = self.held.as_bytes();
                    let mut end = None;
                    while at < b.len() {
                        let c = b[at];
                        at += 1;
                        if in_string {
                            match (escaped, c) {
                                (true, _) => escaped = false,
                                (false, b'\\') => escaped = true,
                                (false, b'"') => in_string = false,
                                _ => {}
                            }
                        } else {
                            match c {
                                b'"' => in_string = true,
                                b'{' | b'[' => depth += 1,
                                b'}' | b']' => {
                                    depth = depth.saturating_sub(1);
                                    if depth == 0 {
                                        end = Some(at);
                                        break;
                                    }
                                }
                                _ => {}
                            }
                        }
                    }
                    let Some(end) = end else {
                        self.state = Bare::Object {
                            start,
                            at,
                            depth,
                            in_string,
                            escaped,
                        };
                        return (out, None);
                    };
                    match parse_call_of(&self.held[start..end], self.format) {
                        Some(c) => {
                            out.push(Piece::Call(c));
                            self.held.drain(..end);
                            self.state = Bare::Closing;
                        }
                        // Not what the grammar admits (no grammar held it): text.
                        None => return (out, Some(std::mem::take(&mut self.held))),
                    }
                }
                Bare::Closing => match closing(&self.held, false) {
                    None => return (out, None),
                    // In the JSON format the next call is bare too, on a line of its own.
                    Some(at) if self.format == CallFormat::Json => {
                        self.held.drain(..at);
                        if self.held.is_empty() {
                            self.state = Bare::Opening;
                            return (out, None);
                        }
                        self.state = Bare::Opening;
                    }
                    Some(at) => return (out, Some(self.held.split_off(at))),
                },
            }
        }
    }
}

/// What a streamed answer becomes: text to send as it comes, or a whole call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Finds tool calls in an answer as it streams: text is passed on at once except what may be
/// the start of a `<tool_call>` tag, and a call is held until its closing tag. Linear in the
/// answer: each byte is looked at a bounded number of times.
#[derive(Debug, Default)]
pub struct ToolStream {
    /// Text not passed on yet: a possible tag start (after at most [`HELD_NEWLINES`]
    /// newlines), or a call's body.
    held: String,
    in_call: bool,
    /// How much of a call's body was searched for the closing tag already.
    searched: usize,
}

/// Newlines held back before a possible tag: past this many they are text.
const HELD_NEWLINES: usize = 64;

impl ToolStream {
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                // Only the new text (and a tag cut by the last push) is searched: linear.
                let mut from = self.searched.saturating_sub(CLOSE.len() - 1);
                while !self.held.is_char_boundary(from) {
                    from -= 1;
                }
                let Some(end) = self.held[from..].find(CLOSE).map(|e| e + from) else {
                    self.searched = self.held.len();
                    break;
                };
                self.searched = 0;
                let body = self.held[..end].to_string();
                let rest = self.held[end + CLOSE.len()..].to_string();
                match parse_call(&body) {
                    Some(c) => out.push(Piece::Call(c)),
                    None => out.push(Piece::Text(format!("{OPEN}{body}{CLOSE}"))),
                }
                self.held = rest;
                self.in_call = false;
            } else if let Some(start) = self.held.find(OPEN) {
                let before = &self.held[..start];
                // The newline a model puts between text (or calls) and a call is layout.
                let before = before.trim_end_matches('\n');
                if !before.is_empty() {
                    out.push(Piece::Text(before.to_string()));
                }
                self.held = self.held[start + OPEN.len()..].to_string();
                self.in_call = true;
                self.searched = 0;
            } else {
                // Pass on all but a tail that may begin the tag.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&k| self.held.ends_with(&OPEN[..k]))
                    .unwrap_or(0);
                let mut cut = self.held.len() - keep;
                // Newlines just before a tag are layout: hold them (a bounded run) until what
                // follows shows whether a call comes.
                let floor = cut.saturating_sub(HELD_NEWLINES);
                while cut > floor && self.held.as_bytes()[cut - 1] == b'\n' {
                    cut -= 1;
                }
                if cut > 0 {
                    out.push(Piece::Text(self.held[..cut].to_string()));
                    self.held.drain(..cut);
                }
                break;
            }
        }
        out
    }

    /// The end of the answer: whatever is held is text (an unclosed call included).
    pub fn finish(&mut self) -> Vec<Piece> {
        let held = std::mem::take(&mut self.held);
        let text = if self.in_call {
            format!("{OPEN}{held}")
        } else {
            held
        };
        self.in_call = false;
        if text.is_empty() {
            Vec::new()
        } else {
            vec![Piece::Text(text)]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `text` one character at a time.
    fn streamed(shape: &Shape, text: &str) -> Answer {
        let mut s = Splitter::new(shape);
        let mut parts = Vec::new();
        for ch in text.chars() {
            parts.extend(s.push(&ch.to_string()));
        }
        parts.extend(s.finish());
        let mut a = Answer::default();
        for p in parts {
            match p {
                Part::Reasoning(r) => a.reasoning.push_str(&r),
                Part::Text(t) => a.text.push_str(&t),
                Part::Call(c) => a.calls.push(c),
            }
        }
        a
    }

    #[test]
    fn a_thinking_section_is_split_off_whole_and_streamed() {
        let may = Shape {
            thinking: Some(Thinking::MayOpen),
            tools: None,
            tool_format: CallFormat::Hermes,
        };
        let inside = Shape {
            thinking: Some(Thinking::Inside),
            tools: None,
            tool_format: CallFormat::Hermes,
        };
        for (shape, text, reasoning, answer) in [
            (
                &may,
                "<think>\nsum them\n</think>\n\nIt is 4.",
                "\nsum them\n",
                "It is 4.",
            ),
            (&may, "  <think>a<b</think>x", "a<b", "x"),
            (&may, "It is 4.", "", "It is 4."),
            (&may, "<thin", "", "<thin"),
            (
                &may,
                "Text then <think>no</think>",
                "",
                "Text then <think>no</think>",
            ),
            (
                &inside,
                "sum them</think>\n\nIt is 4.",
                "sum them",
                "It is 4.",
            ),
            (&inside, "never closed </thi", "never closed </thi", ""),
        ] {
            for a in [Splitter::split(shape, text), streamed(shape, text)] {
                assert_eq!(a.reasoning, reasoning, "{text:?}");
                assert_eq!(a.text, answer, "{text:?}");
            }
        }
    }

    #[test]
    fn reasoning_then_a_call() {
        let shape = Shape {
            thinking: Some(Thinking::Inside),
            tools: Some(vec!["w".to_string()].into()),
            tool_format: CallFormat::Hermes,
        };
        let text = "I need the weather.</think>\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {}}\n</tool_call>";
        for a in [Splitter::split(&shape, text), streamed(&shape, text)] {
            assert_eq!(a.reasoning, "I need the weather.");
            assert_eq!(a.text, "");
            assert_eq!(a.calls.len(), 1);
            assert_eq!(a.calls[0].name, "w");
        }
    }

    #[test]
    fn a_bare_call_at_the_start_is_a_call_and_a_json_answer_naming_no_tool_is_text() {
        let shape = Shape {
            thinking: None,
            tools: Some(vec!["get_weather".to_string()].into()),
            tool_format: CallFormat::Hermes,
        };
        for text in [
            "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\"city\": \"Paris\"}\n}\n```",
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}",
            "  {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n```",
            "<tools>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tools>",
        ] {
            for a in [Splitter::split(&shape, text), streamed(&shape, text)] {
                assert_eq!(a.text, "", "{text:?}");
                assert_eq!(a.calls.len(), 1, "{text:?}");
                assert_eq!(a.calls[0].name, "get_weather");
                assert_eq!(a.calls[0].arguments, "{\"city\":\"Paris\"}");
            }
        }
        let then_tagged = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"a}b\\\"\"}}\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {}}\n</tool_call>";
        for a in [
            Splitter::split(&shape, then_tagged),
            streamed(&shape, then_tagged),
        ] {
            assert_eq!(a.calls.len(), 2, "{a:?}");
            assert_eq!(a.calls[0].arguments, "{\"city\":\"a}b\\\"\"}");
        }
        for text in [
            "```json\n{\"name\": \"get_author\"}\n```",
            "{\"a\": 1}",
            "```python\nprint(1)\n```",
            "Sure: {\"name\": \"get_weather\"}",
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
        ] {
            for a in [Splitter::split(&shape, text), streamed(&shape, text)] {
                assert_eq!(a.text, text, "{text:?}");
                assert!(a.calls.is_empty());
            }
        }
    }

    #[test]
    fn calls_in_the_json_format_are_found_one_per_line() {
        let shape = Shape {
            thinking: None,
            tools: Some(vec!["w".to_string()].into()),
            tool_format: CallFormat::Json,
        };
        let text =
            "{\"name\": \"w\", \"parameters\": {\"a\": 1}}\n{\"name\": \"w\", \"parameters\": {}}";
        for a in [Splitter::split(&shape, text), streamed(&shape, text)] {
            assert_eq!(a.calls.len(), 2, "{a:?}");
            assert_eq!(a.calls[0].arguments, "{\"a\":1}");
            assert!(a.text.is_empty(), "{a:?}");
        }
    }

    #[test]
    fn a_long_thinking_section_streams_in_linear_work() {
        let mut s = ThinkSplit::new(Thinking::Inside);
        let mut n = 0;
        for _ in 0..200_000 {
            n += s.push("<").len();
        }
        assert!(s.held.len() < THINK_CLOSE.len());
        assert!(n > 0);
    }

    /// An answer's text and its calls, with tools offered.
    fn split_calls(text: &str) -> (String, Vec<ToolCall>) {
        let shape = Shape {
            thinking: None,
            tools: Some(vec!["get_weather".to_string(), "noop".to_string()].into()),
            tool_format: CallFormat::Hermes,
        };
        let a = Splitter::split(&shape, text);
        (a.text, a.calls)
    }

    #[test]
    fn calls_are_split_from_text_whole_and_streamed_byte_by_byte() {
        let answer = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"noop\"}\n</tool_call>";
        let (text, calls) = split_calls(answer);
        assert_eq!(text, "Let me check.");
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: "{\"city\":\"Paris\"}".into()
                },
                ToolCall {
                    name: "noop".into(),
                    arguments: "{}".into()
                }
            ]
        );
        let mut s = ToolStream::default();
        let mut pieces = Vec::new();
        for ch in answer.chars() {
            pieces.extend(s.push(&ch.to_string()));
        }
        pieces.extend(s.finish());
        let streamed_calls: Vec<_> = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Call(c) => Some(c.clone()),
                _ => None,
            })
            .collect();
        let streamed_text: String = pieces
            .iter()
            .filter_map(|p| match p {
                Piece::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(streamed_calls, calls);
        assert_eq!(streamed_text, "Let me check.");
        // A broken call stays text; an unclosed one too; a lone `<` is passed on at the end.
        assert_eq!(split_calls("<tool_call>\nnot json\n</tool_call>").1, vec![]);
        assert_eq!(split_calls("a <tool_call> b").0, "a <tool_call> b");
        assert_eq!(split_calls("x <").0, "x <");
    }

    #[test]
    fn a_long_call_body_and_a_long_newline_run_stream_in_linear_work() {
        // 200k pushes each of a byte: quadratic rescans would take minutes.
        let mut s = ToolStream::default();
        let mut n = 0;
        for _ in 0..100_000 {
            n += s.push("\n").len();
        }
        assert!(s.held.len() <= HELD_NEWLINES + OPEN.len());
        s.push(OPEN);
        for _ in 0..100_000 {
            assert!(s.push("a").is_empty());
        }
        let out = s.push(CLOSE);
        assert_eq!(out.len(), 1, "the broken call is passed on as text");
        assert!(n > 0);
    }
}

//! Stop strings over streamed text: text that might be the start of a stop string is held back
//! until it is known not to be.
//!
//! Each stop string is followed by a KMP automaton over the bytes generated so far: its state
//! is the longest suffix of the text that is a prefix of the stop string. So each generated
//! byte costs a constant amount of work per stop string, however long the strings are.

/// One stop string and how much of it the text currently ends with.
#[derive(Debug, Clone)]
struct Automaton {
    stop: Vec<u8>,
    /// `fail[i]`: the longest proper prefix of `stop[..=i]` that is also its suffix.
    fail: Vec<usize>,
    /// Bytes of `stop` the text ends with.
    state: usize,
}

impl Automaton {
    fn new(stop: &str) -> Self {
        let stop = stop.as_bytes().to_vec();
        let mut fail = vec![0; stop.len()];
        let mut k = 0;
        for i in 1..stop.len() {
            while k > 0 && stop[i] != stop[k] {
                k = fail[k - 1];
            }
            if stop[i] == stop[k] {
                k += 1;
            }
            fail[i] = k;
        }
        Automaton {
            stop,
            fail,
            state: 0,
        }
    }

    /// Feeds one byte; `true` when the text now ends with the whole stop string.
    fn feed(&mut self, b: u8) -> bool {
        if self.state == self.stop.len() {
            self.state = self.fail[self.state - 1];
        }
        while self.state > 0 && self.stop[self.state] != b {
            self.state = self.fail[self.state - 1];
        }
        if self.stop[self.state] == b {
            self.state += 1;
        }
        self.state == self.stop.len()
    }
}

/// Tracks generated text against a set of stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<Automaton>,
    /// Text not yet released: at most the longest stop string's length.
    held: String,
    /// Which stop string ended the text.
    matched: Option<usize>,
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopStep {
    /// Text safe to emit; generation goes on.
    Continue(String),
    /// A stop string matched: emit this text (everything before the stop string) and stop.
    Stop(String),
}

impl StopMatcher {
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        StopMatcher {
            stops: stops
                .into_iter()
                .filter(|s| !s.is_empty())
                .map(|s| Automaton::new(&s))
                .collect(),
            held: String::new(),
            matched: None,
        }
    }

    /// The stop string that ended the text, once one has.
    pub fn matched(&self) -> Option<&str> {
        self.matched
            .and_then(|i| std::str::from_utf8(&self.stops[i].stop).ok())
    }

    pub fn push(&mut self, text: &str) -> StopStep {
        let base = self.held.len();
        self.held.push_str(text);
        // The earliest start of any stop string completed within this text.
        let mut first: Option<(usize, usize)> = None;
        for (i, &b) in text.as_bytes().iter().enumerate() {
            for (k, a) in self.stops.iter_mut().enumerate() {
                if a.feed(b) {
                    let start = base + i + 1 - a.stop.len();
                    if first.is_none_or(|(f, _)| start < f) {
                        first = Some((start, k));
                    }
                }
            }
        }
        if let Some((at, k)) = first {
            self.matched = Some(k);
            let out = self.held[..at].to_string();
            self.held.clear();
            for a in &mut self.stops {
                a.state = 0;
            }
            return StopStep::Stop(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string (a prefix
        // of a UTF-8 string starts on a character boundary, and so does its copy here).
        let keep = self.stops.iter().map(|a| a.state).max().unwrap_or(0);
        let cut = self.held.len() - keep.min(self.held.len());
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopStep::Continue(out)
    }

    /// Text still held when generation ends for another reason.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_string_split_across_pushes_is_found_and_cut() {
        let mut m = StopMatcher::new(["END".to_string()]);
        assert_eq!(m.push("abc E"), StopStep::Continue("abc ".into()));
        assert_eq!(m.push("N"), StopStep::Continue(String::new()));
        assert_eq!(m.push("Dxyz"), StopStep::Stop(String::new()));
    }

    #[test]
    fn a_false_start_is_released() {
        let mut m = StopMatcher::new(["END".to_string()]);
        assert_eq!(m.push("EN"), StopStep::Continue(String::new()));
        assert_eq!(m.push("x"), StopStep::Continue("ENx".into()));
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn earliest_of_several_stops_wins() {
        let mut m = StopMatcher::new(["b".to_string(), "cd".to_string()]);
        assert_eq!(m.push("a cd b"), StopStep::Stop("a ".into()));
        assert_eq!(m.matched(), Some("cd"));
        let mut m = StopMatcher::new(["bc".to_string(), "abcd".to_string()]);
        assert_eq!(m.push("xabcd"), StopStep::Stop("x".into()));
    }

    #[test]
    fn overlapping_prefixes_are_followed_and_multibyte_text_is_cut_on_boundaries() {
        let mut m = StopMatcher::new(["aab".to_string()]);
        assert_eq!(m.push("a"), StopStep::Continue(String::new()));
        assert_eq!(m.push("a"), StopStep::Continue(String::new()));
        assert_eq!(m.push("a"), StopStep::Continue("a".into()));
        assert_eq!(m.push("b!"), StopStep::Stop(String::new()));
        let mut m = StopMatcher::new(["東京タワー".to_string()]);
        assert_eq!(m.push("ここは東京"), StopStep::Continue("ここは".into()));
        assert_eq!(m.push("駅"), StopStep::Continue("東京駅".into()));
    }

    /// Long stop strings cost the same per generated byte as short ones: every push is
    /// bounded work, and what is held back never exceeds the longest stop string.
    #[test]
    fn long_stop_strings_hold_back_at_most_their_length() {
        let long = "x".repeat(450_000);
        let mut m = StopMatcher::new([long.clone(), format!("{long}y"), "z".into()]);
        let mut out = String::new();
        for _ in 0..1000 {
            match m.push("xxxx") {
                StopStep::Continue(t) => out.push_str(&t),
                StopStep::Stop(_) => panic!("no stop string was generated"),
            }
        }
        assert!(m.held.len() <= long.len() + 1);
        assert_eq!(out.len() + m.held.len(), 4000);
        assert_eq!(m.push("z"), StopStep::Stop("x".repeat(4000)));
    }
}

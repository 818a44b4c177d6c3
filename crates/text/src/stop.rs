//! Stop strings over streamed text: text that might be the start of a stop string is held back
//! until it is known not to be.

/// Tracks generated text against a set of stop strings.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
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
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> StopStep {
        self.held.push_str(text);
        let first_match = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min();
        if let Some(at) = first_match {
            let out = self.held[..at].to_string();
            self.held.clear();
            return StopStep::Stop(out);
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.held.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.held.len() - keep;
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
    }
}

//! The last shard's grammar work, off the compute thread.
//!
//! A constrained session's mask for its next token depends only on the tokens it already
//! has, all of them known when a step arrives. So the compute thread hands each such session's
//! grammar to a small pool of threads of their own before the forward pass and takes it back,
//! with the mask, after: the masks are computed while the model runs, on stacks no grammar can
//! overflow ([`constrain::GRAMMAR_STACK_BYTES`]). A grammar compiles there too, at its
//! session's first mask (or after a rewind its matcher cannot follow), never on the compute
//! thread. A mask not ready within the step's grammar budget fails its own session (typed
//! `grammar_budget`) and holds up no other: the step samples everyone else and goes on. The
//! late answer still comes back, and its grammar returns to its session at the next step
//! (rewound to what the session then holds), so a discarded early step loses nothing.

use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use constrain::{Constraint, Error, LazyVocabulary};

/// Threads computing masks: one slow grammar occupies one of them, not every session's.
const GRAMMAR_THREADS: usize = 4;

/// A session's grammar as the compute thread holds it.
pub(crate) enum Grammar {
    /// Unconstrained.
    None,
    /// To be compiled on a grammar thread at the next mask (its text, in llguidance's form).
    Uncompiled(Arc<str>),
    /// Compiled, with its text (to compile again should a rewind be more than the matcher
    /// can roll back).
    Ready(Box<Constraint>, Arc<str>),
    /// On a grammar thread: a step in progress, or a mask that missed its budget and has not
    /// come back yet.
    Away,
}

impl Grammar {
    /// Forgets generated tokens past the first `n` (the session was rewound). A matcher that
    /// cannot roll back that far is compiled again on a grammar thread, not here.
    pub fn rewind(&mut self, n: usize) {
        if let Grammar::Ready(c, text) = self {
            if !c.try_rewind(n) {
                *self = Grammar::Uncompiled(Arc::clone(text));
            }
        }
    }

    pub fn is_none(&self) -> bool {
        matches!(self, Grammar::None)
    }

    pub fn is_away(&self) -> bool {
        matches!(self, Grammar::Away)
    }
}

/// One session's work: its grammar and every token it has generated.
struct Job<K> {
    step: u64,
    key: K,
    grammar: Grammar,
    generated: Vec<u32>,
}

/// A job's answer: the grammar back (compiled and advanced) and the mask, or why not.
pub(crate) struct Done<K> {
    pub step: u64,
    pub key: K,
    pub grammar: Grammar,
    pub mask: Result<Vec<u32>, Error>,
}

/// The threads that compute every constrained session's masks, and the answers they send.
pub(crate) struct GrammarThreads<K> {
    vocab: Arc<LazyVocabulary>,
    jobs: Sender<Job<K>>,
    answers: Receiver<Done<K>>,
    next_step: u64,
}

impl<K: Send + 'static> GrammarThreads<K> {
    /// Starts the threads; their grammars compile against `vocab`.
    pub fn start(vocab: Arc<LazyVocabulary>) -> std::io::Result<Self> {
        let (jobs, rx) = mpsc::channel::<Job<K>>();
        let (done, answers) = mpsc::channel::<Done<K>>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..GRAMMAR_THREADS {
            let (rx, done, vocab) = (Arc::clone(&rx), done.clone(), Arc::clone(&vocab));
            std::thread::Builder::new()
                .name(format!("strata-grammar-{i}"))
                .stack_size(constrain::GRAMMAR_STACK_BYTES)
                .spawn(move || loop {
                    let job = match rx.lock().unwrap_or_else(|e| e.into_inner()).recv() {
                        Ok(job) => job,
                        Err(_) => return,
                    };
                    // The engine's calls are guarded already; this keeps the thread alive
                    // through anything else.
                    let (grammar, mask) =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            run(&vocab, job.grammar, &job.generated)
                        }))
                        .unwrap_or_else(|_| {
                            // The grammar is lost: its session fails now and at every later step.
                            let e = Error::Grammar("the grammar engine failed".into());
                            (Grammar::Away, Err(e))
                        });
                    let answer = Done {
                        step: job.step,
                        key: job.key,
                        grammar,
                        mask,
                    };
                    if done.send(answer).is_err() {
                        return;
                    }
                })?;
        }
        Ok(GrammarThreads {
            vocab,
            jobs,
            answers,
            next_step: 0,
        })
    }

    /// Starts one step's masks: each `(key, grammar, generated tokens)` goes to the threads.
    /// A grammar to compile needs the vocabulary, built in the background from the shard's
    /// start (about half a second, seconds on a busy machine): a step bringing one first waits
    /// here for that build, once, so that it is not counted against the grammar's budget.
    pub fn start_step(&mut self, work: Vec<(K, Grammar, Vec<u32>)>) -> Pending {
        if work
            .iter()
            .any(|(_, g, _)| matches!(g, Grammar::Uncompiled(_)))
        {
            self.vocab.wait_warm();
        }
        self.next_step += 1;
        let step = self.next_step;
        let mut n = 0;
        for (key, grammar, generated) in work {
            let job = Job {
                step,
                key,
                grammar,
                generated,
            };
            // The threads only end with the process; a job that cannot be sent leaves its
            // session's answer missing, which fails it like a missed budget.
            if self.jobs.send(job).is_ok() {
                n += 1;
            }
        }
        Pending { step, n }
    }

    /// The answers of step `pending` that arrive by `deadline`, and every late answer of an
    /// earlier step that arrived meanwhile (their masks are stale; their grammars go back to
    /// their sessions).
    pub fn finish(&self, pending: Pending, deadline: Instant) -> (Vec<Done<K>>, Vec<Done<K>>) {
        let (mut now, mut late) = (Vec::with_capacity(pending.n), Vec::new());
        while now.len() < pending.n {
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.answers.recv_timeout(wait) {
                Ok(d) if d.step == pending.step => now.push(d),
                Ok(d) => late.push(d),
                Err(_) => break,
            }
        }
        (now, late)
    }

    /// Late answers that have arrived, without waiting.
    pub fn late(&self) -> Vec<Done<K>> {
        self.answers.try_iter().collect()
    }
}

/// Compiles the grammar if it is not yet, consumes the tokens it has not seen, and computes
/// the mask of the next token. Panics in the engine are errors ([`constrain`] guards them).
fn run(
    vocab: &LazyVocabulary,
    grammar: Grammar,
    generated: &[u32],
) -> (Grammar, Result<Vec<u32>, Error>) {
    let (mut c, text) = match grammar {
        Grammar::Ready(c, text) => (c, text),
        Grammar::Uncompiled(text) => match vocab.get().and_then(|v| v.compile(&text)) {
            Ok(c) => (Box::new(c), text),
            Err(e) => return (Grammar::Uncompiled(text), Err(e)),
        },
        other => return (other, Err(Error::Grammar("no grammar to run".into()))),
    };
    let mask = c.advance(generated).and_then(|()| c.mask());
    (Grammar::Ready(c, text), mask)
}

/// One step's masks on their way.
pub(crate) struct Pending {
    step: u64,
    n: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A shard's first grammar arrives while its vocabulary is still being built (Qwen's 151k
    /// tokens, half a second or more): the step waits for the build before its masks start, so
    /// the grammar's budget counts only the compile and the mask. Charged for the build, this
    /// mask missed its 200 ms budget on a busy CI machine.
    #[test]
    fn a_grammar_arriving_while_the_vocabulary_builds_is_not_charged_for_the_build() {
        let file = gguf::GgufFile::open(testkit::named_model("qwen2.5-coder-0.5b")).unwrap();
        let tokenizer = text::Tokenizer::from_header(file.header()).unwrap();
        let vocab = LazyVocabulary::new(Arc::new(tokenizer), constrain::Purpose::Masks);
        fn nothing() {}
        vocab.warm(nothing);
        let mut threads = GrammarThreads::<u32>::start(Arc::clone(&vocab)).unwrap();
        let text: Arc<str> = constrain::grammar::json_object().into();
        let pending = threads.start_step(vec![(7, Grammar::Uncompiled(text), Vec::new())]);
        let started = Instant::now();
        let (answers, late) = threads.finish(pending, started + Duration::from_millis(200));
        assert!(late.is_empty());
        assert_eq!(answers.len(), 1, "the mask came back within the budget");
        let mask = answers[0].mask.as_ref().unwrap();
        assert!(
            mask.iter().any(|&w| w != 0),
            "some token may start a JSON object"
        );
        assert!(matches!(answers[0].grammar, Grammar::Ready(..)));
    }
}

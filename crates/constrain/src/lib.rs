//! Constrained decoding: a session's output held to a grammar (a JSON schema, a tool call)
//! while it is sampled.
//!
//! The grammar engine is llguidance (the library llama.cpp and mistral.rs use): it compiles
//! JSON schemas and Lark grammars and computes, per step, the set of tokens that keep the
//! output inside the grammar. This crate gives it the model's vocabulary ([`Vocabulary`]),
//! builds the grammars the API asks for ([`grammar`]), and keeps one session's matcher in step
//! with the session's tokens ([`Constraint`]): tokens are consumed when they come back as the
//! next step's input, and a rewound session rolls its matcher back, so a replayed session
//! continues the same document.
//!
//! The mask is applied after the logits (the sampler sets what it forbids to -inf), so
//! batch invariance holds: a row's mask depends on its session alone.

pub mod grammar;
pub mod limits;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::earley::SlicedBiasComputer;
use llguidance::{Matcher, ParserFactory};
use text::{TokenKind, Tokenizer};
use toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// What went wrong: a grammar that does not compile (or that asks for something llguidance
/// does not support), or tokens the grammar does not allow.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the grammar is invalid: {0}")]
    Grammar(String),
    #[error("the output left the grammar: {0}")]
    Rejected(String),
    /// A schema over one of [`limits::LIMITS`]; `limit` names it.
    #[error("{message} (`{limit}`)")]
    TooLarge {
        limit: &'static str,
        message: String,
    },
}

/// The longest engine message passed on: the first line, cut to this many bytes (llguidance
/// can describe its whole parser state in an error, which is no client's business).
const MAX_MESSAGE_BYTES: usize = 200;

/// An engine error as the API shows it: its first line, bounded.
fn brief(e: impl std::fmt::Display) -> String {
    let s = e.to_string();
    let line = s.lines().next().unwrap_or("").trim();
    if line.len() <= MAX_MESSAGE_BYTES {
        return line.to_string();
    }
    let mut end = MAX_MESSAGE_BYTES;
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &line[..end])
}

/// Stack for grammar work: llguidance compiles a grammar recursively, so the work runs on a
/// thread of its own with room to spare for any schema [`limits::LIMITS`] admits (the default
/// 2 MiB of a runtime worker overflowed on 7000 properties and aborted the process).
pub const GRAMMAR_STACK_BYTES: usize = 64 << 20;

/// Runs `f` on a thread with [`GRAMMAR_STACK_BYTES`] of stack and waits for it (the pages
/// are reserved, not touched: only what the work uses becomes resident).
pub fn on_grammar_stack<T: Send>(f: impl FnOnce() -> T + Send) -> Result<T, Error> {
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name("strata-grammar".into())
            .stack_size(GRAMMAR_STACK_BYTES)
            .spawn_scoped(scope, f)
            .map_err(|e| Error::Grammar(format!("no thread for the grammar: {e}")))?
            .join()
            .map_err(|_| Error::Grammar("the grammar engine failed on this grammar".into()))
    })
}

/// The model's vocabulary as llguidance sees it: each token's bytes in a trie (control tokens
/// marked as special, so a grammar never produces them from text), plus the tokenizer for
/// the text a grammar forces.
struct Env {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false, false)
    }

    fn tokenize_is_canonical(&self) -> bool {
        // Our encoder is not llguidance's reference tokenizer; it is only used to force text.
        false
    }
}

/// A model's vocabulary ready for grammars: built once per process (a trie of every token,
/// tens of milliseconds for 150k tokens), shared by every session.
pub struct Vocabulary {
    factory: ParserFactory,
    /// Grammars compiled lately, by their text, each as a matcher that has consumed nothing:
    /// agents send the same tools and schemas request after request, and a copy costs far
    /// less than compiling again.
    compiled: std::sync::Mutex<Compiled>,
}

/// The most grammars [`Vocabulary`] keeps compiled, and the most bytes of their text.
const CACHED_GRAMMARS: usize = 32;
const CACHED_GRAMMAR_BYTES: usize = 4 << 20;

/// Recently compiled grammars, least recently used first.
#[derive(Default)]
struct Compiled {
    order: std::collections::VecDeque<Arc<str>>,
    by_text: std::collections::HashMap<Arc<str>, Matcher>,
    bytes: usize,
}

impl Compiled {
    fn get(&mut self, text: &str) -> Option<Matcher> {
        let m = self.by_text.get(text)?.deep_clone();
        if let Some(i) = self.order.iter().position(|t| &**t == text) {
            let t = self.order.remove(i).expect("a position in the queue");
            self.order.push_back(t);
        }
        Some(m)
    }

    fn put(&mut self, text: &str, m: &Matcher) {
        if self.by_text.contains_key(text) || text.len() > CACHED_GRAMMAR_BYTES {
            return;
        }
        while self.order.len() >= CACHED_GRAMMARS || self.bytes + text.len() > CACHED_GRAMMAR_BYTES
        {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.bytes -= old.len();
            self.by_text.remove(&old);
        }
        let t: Arc<str> = text.into();
        self.bytes += t.len();
        self.by_text.insert(Arc::clone(&t), m.deep_clone());
        self.order.push_back(t);
    }
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Vocabulary({} tokens)",
            self.factory.tok_env().tok_trie().vocab_size()
        )
    }
}

/// What a [`Vocabulary`] is for, which decides what it precomputes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// Token masks, one per sampled token (the shard that samples): llguidance's token sets
    /// for the regexes JSON strings and whitespace use are built once, so a mask inside a long
    /// string costs a fraction of a walk of the whole vocabulary. They take memory in
    /// proportion to the vocabulary (about 70 MiB at 150k tokens).
    Masks,
    /// Only compiling grammars, to refuse one that does not compile before anything is queued
    /// (the tracker): no token sets, since no mask is computed. A mask computed anyway is the
    /// same, only slower.
    Checks,
}

impl Vocabulary {
    /// The vocabulary of `tokenizer`; generation ends with its end-of-turn token where it has
    /// one (what a chat answer ends with), else its end-of-sequence token.
    pub fn new(tokenizer: Arc<Tokenizer>, purpose: Purpose) -> Result<Self, Error> {
        let n = tokenizer.n_vocab();
        let words: Vec<Vec<u8>> = (0..n as u32)
            .map(|id| match tokenizer.kind(id) {
                Some(TokenKind::Control | TokenKind::Unknown | TokenKind::Unused) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.token_text(id).unwrap_or("").as_bytes());
                    w
                }
                _ => tokenizer.token_bytes(id, false).unwrap_or_default(),
            })
            .collect();
        let eos = tokenizer.eot.or(tokenizer.eos).unwrap_or(0);
        let info = TokRxInfo {
            vocab_size: n as u32,
            tok_eos: eos,
            tok_bos: tokenizer.bos,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: tokenizer.eot,
        };
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let slices = match purpose {
            Purpose::Masks => SlicedBiasComputer::general_slices(),
            Purpose::Checks => Vec::new(),
        };
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &slices)
            .map_err(|e| Error::Grammar(brief(e)))?;
        factory.quiet();
        // Errors say what went wrong, not the parser's state and the whole grammar.
        factory.limits_mut().verbose_errors = false;
        Ok(Vocabulary {
            factory,
            compiled: Default::default(),
        })
    }

    /// Compiles a grammar in llguidance's JSON form (what [`grammar`] builds and the wire
    /// carries) into a fresh constraint.
    /// A grammar compiled lately is copied, not compiled again.
    pub fn compile(self: &Arc<Self>, grammar: &str) -> Result<Constraint, Error> {
        let parsed: TopLevelGrammar =
            serde_json::from_str(grammar).map_err(|e| Error::Grammar(brief(e)))?;
        let cached = self.cache().get(grammar);
        let matcher = match cached {
            Some(m) => m,
            None => {
                let m = self.matcher(parsed.clone())?;
                self.cache().put(grammar, &m);
                m
            }
        };
        Ok(Constraint {
            vocab: Arc::clone(self),
            grammar: parsed,
            matcher,
            consumed: 0,
        })
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, Compiled> {
        self.compiled.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn matcher(&self, grammar: TopLevelGrammar) -> Result<Matcher, Error> {
        let parser = guarded(|| self.factory.create_parser(grammar))
            .map_err(Error::Grammar)?
            .map_err(|e| Error::Grammar(brief(e)))?;
        let m = Matcher::new(Ok(parser));
        match m.get_error() {
            Some(e) => Err(Error::Grammar(brief(e))),
            None => Ok(m),
        }
    }

    /// Everything the grammar engine would refuse later, found now: compiles `grammar` and
    /// computes its first mask, on a thread of its own stack ([`on_grammar_stack`]). What
    /// passes here starts on a shard the same way.
    pub fn check(self: &Arc<Self>, grammar: &str) -> Result<(), Error> {
        on_grammar_stack(|| {
            let mut c = self.compile(grammar)?;
            c.mask().map(drop).map_err(|e| match e {
                Error::Rejected(m) => Error::Grammar(m),
                e => e,
            })
        })?
    }
}

/// Runs grammar code that should never panic, turning a panic into an error: a request's
/// grammar must not be able to take down the thread that samples for every session.
fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .map_err(|_| "the grammar engine failed on this grammar".to_string())
}

/// One session's grammar state: the matcher and how many generated tokens it has consumed.
pub struct Constraint {
    vocab: Arc<Vocabulary>,
    grammar: TopLevelGrammar,
    matcher: Matcher,
    consumed: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({} tokens consumed)", self.consumed)
    }
}

impl Constraint {
    /// How many generated tokens the matcher has consumed.
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    /// Forgets the generated tokens past the first `n` without compiling anything: `false`
    /// when the matcher cannot roll back that far (the caller compiles it again elsewhere).
    pub fn try_rewind(&mut self, n: usize) -> bool {
        if n >= self.consumed {
            return true;
        }
        if self.matcher.rollback(self.consumed - n).is_ok() && !self.matcher.is_error() {
            self.consumed = n;
            return true;
        }
        false
    }

    /// Forgets the generated tokens past the first `n` (the session was rewound). Where the
    /// matcher cannot roll back that far it starts over, and [`Constraint::advance`] consumes
    /// the kept tokens again.
    pub fn rewind(&mut self, n: usize) {
        if self.try_rewind(n) {
            return;
        }
        match self.vocab.matcher(self.grammar.clone()) {
            Ok(m) => self.matcher = m,
            // It compiled before; should it not now, the matcher stays in error and the
            // next mask says so.
            Err(_) => return,
        }
        self.consumed = 0;
    }

    /// Consumes the generated tokens it has not seen (`generated` is every generated token
    /// of the session, in order; those before `consumed()` were consumed already).
    pub fn advance(&mut self, generated: &[u32]) -> Result<(), Error> {
        let new = generated.get(self.consumed..).unwrap_or(&[]);
        if new.is_empty() {
            return Ok(());
        }
        guarded(|| self.matcher.consume_tokens(new))
            .map_err(Error::Rejected)?
            .map_err(|e| Error::Rejected(brief(e)))?;
        self.consumed = generated.len();
        Ok(())
    }

    /// The tokens the grammar allows next, one bit per token in 32-bit words (token `t` is
    /// bit `t % 32` of word `t / 32`); only the end token once the document is complete.
    pub fn mask(&mut self) -> Result<Vec<u32>, Error> {
        let m = guarded(|| self.matcher.compute_mask_or_eos())
            .map_err(Error::Rejected)?
            .map_err(|e| Error::Rejected(brief(e)))?;
        if m.num_set() == 0 {
            return Err(Error::Rejected("no token can continue the output".into()));
        }
        Ok(m.as_slice().to_vec())
    }

    /// Whether the output so far is a complete document.
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }
}

/// A [`Vocabulary`] built on first use, or ahead of it in the background
/// ([`LazyVocabulary::warm`]): the last shard of a route builds one at start so that the
/// first constrained request does not wait for it.
pub struct LazyVocabulary {
    tokenizer: Arc<Tokenizer>,
    purpose: Purpose,
    cell: std::sync::OnceLock<Result<Arc<Vocabulary>, String>>,
    /// The thread [`LazyVocabulary::warm`] started, until someone waited for it.
    warming: std::sync::Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl std::fmt::Debug for LazyVocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LazyVocabulary(built: {})", self.cell.get().is_some())
    }
}

impl LazyVocabulary {
    pub fn new(tokenizer: Arc<Tokenizer>, purpose: Purpose) -> Arc<Self> {
        Arc::new(LazyVocabulary {
            tokenizer,
            purpose,
            cell: std::sync::OnceLock::new(),
            warming: std::sync::Mutex::new(None),
        })
    }

    /// Starts building it on a thread of its own, which then calls `after` (building it
    /// allocates and frees far more than it keeps).
    pub fn warm(self: &Arc<Self>, after: fn()) {
        let me = Arc::clone(self);
        let thread = std::thread::Builder::new()
            .name("strata-grammar-vocab".into())
            .spawn(move || {
                let _ = me.get();
                after();
            });
        *self.warming.lock().unwrap_or_else(|e| e.into_inner()) = thread.ok();
    }

    /// Waits until the build [`LazyVocabulary::warm`] started is over, `after` included (at
    /// once when there was none, or it is over): work timed against a budget starts after
    /// it, not during it.
    pub fn wait_warm(&self) {
        // Held while joining: a second caller waits for the same build.
        let mut warming = self.warming.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(t) = warming.take() {
            let _ = t.join();
        }
    }

    /// The vocabulary (waiting for a build in progress).
    pub fn get(&self) -> Result<&Arc<Vocabulary>, Error> {
        self.cell
            .get_or_init(|| {
                Vocabulary::new(Arc::clone(&self.tokenizer), self.purpose)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .as_ref()
            .map_err(|e| Error::Grammar(e.clone()))
    }
}

//! Single-process generation: one model, one session, text in and out. The building block
//! behind `strata generate`, `strata logits` and `strata bench`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use model::sampling::{self, Sampler, SamplingParams};
use model::{Batch, KvCache, Model, ModelOptions, Output, Row};
use text::{ChatMessage, ChatTemplate, StopMatcher, StopStep, StreamDecoder, Tokenizer};

/// A loaded model with its tokenizer and chat template.
pub struct Local {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    pub file_bytes: usize,
}

/// What to generate.
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// How many top logits to record per generated step (0 for none).
    pub n_top: usize,
    /// Prompt tokens per forward call.
    pub batch_size: usize,
    pub n_ctx: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    Length,
    StopString,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::Length => "length",
            StopReason::StopString => "stop",
        }
    }
}

pub struct GenerateOutput {
    pub generated_ids: Vec<u32>,
    pub text: String,
    pub top: Vec<Vec<(u32, f32)>>,
    pub stop_reason: StopReason,
    pub prompt_time: Duration,
    pub decode_time: Duration,
    /// Time from the start until the first token was sampled.
    pub ttft: Duration,
}

impl Local {
    pub fn load(path: &std::path::Path, opts: ModelOptions) -> Result<Local> {
        let file =
            gguf::GgufFile::open(path).with_context(|| format!("opening {}", path.display()))?;
        let model = Model::load(&file, None, opts)?;
        let tokenizer = Tokenizer::from_header(file.header())?;
        let template = ChatTemplate::from_header(file.header(), &tokenizer)?;
        Ok(Local {
            model,
            tokenizer,
            template,
            file_bytes: file.len(),
        })
    }

    /// Prompt ids for plain text (special tokens parsed, as llama.cpp does for prompts).
    pub fn encode_prompt(&self, prompt: &str) -> Vec<u32> {
        self.tokenizer.encode(prompt, true, true)
    }

    /// Prompt ids for a one-message chat, rendered with the model's template.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let Some(t) = &self.template else {
            bail!(text::Error::NoChatTemplate)
        };
        Ok(self.tokenizer.encode_chat(t, messages)?)
    }

    /// Runs `ids` through the model as a prefill of `cache` in chunks of `batch_size`, with
    /// logits for the last row (or for every row when `all_logits`).
    pub fn prefill(
        &self,
        cache: &mut KvCache,
        ids: &[u32],
        batch_size: usize,
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let mut logits = Vec::new();
        let start = cache.len();
        for (ci, chunk) in ids.chunks(batch_size.max(1)).enumerate() {
            let base = start + ci * batch_size.max(1);
            let rows: Vec<Row> = chunk
                .iter()
                .enumerate()
                .map(|(i, &token)| Row {
                    seq: 0,
                    pos: base + i,
                    token,
                    want_logits: all_logits || base + i == start + ids.len() - 1,
                })
                .collect();
            match self.model.forward(
                Batch {
                    rows: &rows,
                    hidden: None,
                },
                &mut [cache],
            )? {
                Output::Logits(l) => logits.extend(l),
                Output::Hidden(_) => bail!("a whole-model run returned hidden states"),
            }
        }
        Ok(logits)
    }

    /// Generates from `req`, calling `on_text` with each piece of text as it completes.
    pub fn generate(
        &self,
        req: &GenerateRequest,
        mut on_text: impl FnMut(&str),
    ) -> Result<GenerateOutput> {
        if req.prompt_ids.is_empty() {
            bail!("the prompt is empty: at least one token is needed");
        }
        let n_vocab = self.model.config().n_vocab;
        let t0 = Instant::now();
        let mut cache = self.model.new_cache(req.n_ctx);
        let mut logits = self.prefill(&mut cache, &req.prompt_ids, req.batch_size, false)?;
        let prompt_time = t0.elapsed();
        let mut sampler = Sampler::new(req.sampling.clone());
        let mut history = req.prompt_ids.clone();
        let mut out = GenerateOutput {
            generated_ids: Vec::new(),
            text: String::new(),
            top: Vec::new(),
            stop_reason: StopReason::Length,
            prompt_time,
            decode_time: Duration::ZERO,
            ttft: Duration::ZERO,
        };
        let mut decoder = StreamDecoder::new();
        let mut stops = StopMatcher::new(req.stop.iter().cloned());
        let t_decode = Instant::now();
        let mut emit = |s: &str, out: &mut GenerateOutput| {
            if !s.is_empty() {
                on_text(s);
                out.text.push_str(s);
            }
        };
        for step in 0..req.max_tokens {
            if logits.len() != n_vocab {
                bail!("expected {n_vocab} logits, got {}", logits.len());
            }
            if req.n_top > 0 {
                out.top.push(sampling::top_k(&logits, req.n_top));
            }
            let id = sampler.sample(&logits, &history, None);
            if step == 0 {
                out.ttft = t0.elapsed();
            }
            out.generated_ids.push(id);
            history.push(id);
            if self.tokenizer.is_end(id) {
                out.stop_reason = StopReason::Eos;
                break;
            }
            let piece = decoder.push(&self.tokenizer, id)?;
            match stops.push(&piece) {
                StopStep::Continue(s) => emit(&s, &mut out),
                StopStep::Stop(s) => {
                    emit(&s, &mut out);
                    out.stop_reason = StopReason::StopString;
                    break;
                }
            }
            if step + 1 == req.max_tokens || cache.len() >= req.n_ctx {
                break;
            }
            let rows = [Row {
                seq: 0,
                pos: cache.len(),
                token: id,
                want_logits: true,
            }];
            logits = match self.model.forward(
                Batch {
                    rows: &rows,
                    hidden: None,
                },
                &mut [&mut cache],
            )? {
                Output::Logits(l) => l,
                Output::Hidden(_) => bail!("a whole-model run returned hidden states"),
            };
        }
        if out.stop_reason != StopReason::StopString {
            match stops.push(&decoder.finish()) {
                StopStep::Continue(s) => {
                    emit(&s, &mut out);
                    let rest = stops.finish();
                    emit(&rest, &mut out);
                }
                StopStep::Stop(s) => {
                    emit(&s, &mut out);
                    out.stop_reason = StopReason::StopString;
                }
            }
        }
        out.decode_time = t_decode.elapsed();
        Ok(out)
    }
}

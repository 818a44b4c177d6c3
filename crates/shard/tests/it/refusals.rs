//! A shard's typed refusals and KV accounting, driven through the in-memory transport on a tiny
//! model: cache miss, stale epoch, recipe mismatch, KV budget, and exact release.

use std::sync::Arc;
use std::time::Duration;

use crate::common::{config, frag};
use futures::StreamExt;
use proto::v1::{route_msg, CacheRecipe, Fragment, RouteMsg, RouteReply, RouteSetup, Step};
use proto::{ReplyStream, ShardTransport};
use shard::{LocalShard, ShardConfig, ShardCore};
use tokio::sync::mpsc;

fn core(kv_budget_bytes: usize) -> Arc<ShardCore> {
    core_with(kv_budget_bytes, Duration::from_secs(600))
}

fn core_with(kv_budget_bytes: usize, kv_ttl: Duration) -> Arc<ShardCore> {
    ShardCore::load(config(kv_budget_bytes, kv_ttl)).unwrap()
}

/// Weights over their budget are refused at load naming the numbers; a step whose
/// activations exceed the scratch budget has the fragments that do not fit refused, and the
/// shard advertises the most tokens a step may carry.
#[tokio::test]
async fn weights_and_scratch_over_their_budgets_are_refused_with_the_numbers() {
    let e = ShardCore::load(ShardConfig {
        weights_budget_bytes: 1 << 10,
        ..config(1 << 20, Duration::from_secs(600))
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.starts_with("weights_budget on shard test-shard: layers 0..4 hold ")
            && e.ends_with("MiB, more than the budget of 0.0 MiB"),
        "{e}"
    );
    let probe = core(1 << 20);
    let per_token = probe.info.budgets.unwrap().scratch_bytes_per_token as usize;
    // Room for 24 tokens of scratch.
    let c = ShardCore::load(ShardConfig {
        scratch_budget_bytes: 24 * per_token,
        ..config(1 << 20, Duration::from_secs(600))
    })
    .unwrap();
    assert_eq!(c.info.budgets.unwrap().max_step_tokens, 24);
    let digest = c.info.model_digest.clone();
    let mut r = open(&c, 1, &digest).await.unwrap();
    let reply = r
        .step(1, vec![frag(1, 0, &[5; 16]), frag(2, 0, &[6; 16])], vec![])
        .await;
    assert_eq!(reply.outputs.len(), 1, "the first fragment fits");
    assert_eq!(reply.errors.len(), 1);
    let e = &reply.errors[0];
    assert_eq!((e.session_id, e.kind().name()), (2, "capacity"));
    assert!(
        e.message
            .starts_with("scratch_budget on shard test-shard: a step of 32 tokens needs "),
        "{}",
        e.message
    );
    let st = c.stats();
    assert_eq!(st.scratch_bytes_budget, 24 * per_token as u64);
    assert!(
        st.scratch_bytes_last_step > 0 && st.scratch_bytes_last_step <= st.scratch_bytes_budget
    );
}

pub(crate) struct Route {
    tx: mpsc::Sender<RouteMsg>,
    replies: ReplyStream,
    next_step: u64,
}

pub(crate) async fn open(
    core: &Arc<ShardCore>,
    epoch: u64,
    digest: &str,
) -> Result<Route, tonic::Status> {
    open_with(core, epoch, digest, vec![], 0).await
}

async fn open_with(
    core: &Arc<ShardCore>,
    epoch: u64,
    digest: &str,
    recipes: Vec<CacheRecipe>,
    seam_dtype: i32,
) -> Result<Route, tonic::Status> {
    let (tx, rx) = mpsc::channel(8);
    let setup = RouteSetup {
        protocol_version: proto::PROTOCOL_VERSION,
        epoch,
        downstream: vec![],
        seam_dtype,
        model_digest: digest.into(),
        recipes,
        reply_key: 0,
    };
    tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Setup(setup)),
    })
    .await
    .unwrap();
    let replies = LocalShard::new(Arc::clone(core)).route(rx).await?;
    Ok(Route {
        tx,
        replies,
        next_step: 1,
    })
}

/// A session's first fragment as the tracker sends it: the shard may start it on a cached
/// prefix.
fn first_frag(session_id: u64, tokens: &[u32]) -> Fragment {
    Fragment {
        reuse_prefix: true,
        ..frag(session_id, 0, tokens)
    }
}

impl Route {
    pub(crate) async fn step(
        &mut self,
        epoch: u64,
        fragments: Vec<Fragment>,
        release: Vec<u64>,
    ) -> RouteReply {
        let step = Step {
            step_id: self.next_step,
            epoch,
            fragments,
            release,
            activations: vec![],
            liveness_ms: 10_000,
            errors: vec![],
            hops: vec![],
        };
        self.next_step += 1;
        self.tx
            .send(RouteMsg {
                msg: Some(route_msg::Msg::Step(step)),
            })
            .await
            .unwrap();
        tokio::time::timeout(Duration::from_secs(10), self.replies.next())
            .await
            .expect("reply in time")
            .expect("stream open")
            .expect("reply ok")
    }
}

pub(crate) fn reasons(r: &RouteReply) -> Vec<(u64, String)> {
    r.errors
        .iter()
        .map(|e| (e.session_id, e.kind().name().to_string()))
        .collect()
}

#[tokio::test]
async fn unknown_sessions_stale_epochs_and_wrong_models_are_refused_with_their_reason() {
    let core = core(64 << 20);
    let digest = core.info.model_digest.clone();
    let err = open(&core, 1, "not-this-model")
        .await
        .err()
        .expect("a wrong digest is refused");
    assert!(
        err.message().contains("recipe_mismatch"),
        "{}",
        err.message()
    );

    let mut route = open(&core, 1, &digest).await.unwrap();
    let r = route.step(1, vec![frag(1, 0, &[10, 11, 12])], vec![]).await;
    assert_eq!(r.outputs.len(), 1);
    assert!(r.errors.is_empty());
    // A session the shard never saw, continuing at position 3: an explicit cache miss.
    let r = route.step(1, vec![frag(2, 3, &[5])], vec![]).await;
    assert_eq!(reasons(&r), vec![(2, "cache_miss".to_string())]);
    assert!(r.errors[0].message.contains("not held on shard test-shard"));
    // The same session under another epoch: stale.
    let r = route.step(2, vec![frag(1, 3, &[13])], vec![]).await;
    assert_eq!(reasons(&r), vec![(1, "stale_epoch".to_string())]);
    // A gap in positions is a cache miss too, never garbage.
    let r = route.step(1, vec![frag(1, 7, &[13])], vec![]).await;
    assert_eq!(reasons(&r), vec![(1, "cache_miss".to_string())]);
    // The session itself is intact and continues.
    let r = route.step(1, vec![frag(1, 3, &[13])], vec![]).await;
    assert!(r.errors.is_empty() && r.outputs.len() == 1);
}

#[tokio::test]
async fn a_route_expecting_another_cache_recipe_is_refused_naming_the_field() {
    let core = core(64 << 20);
    let digest = core.info.model_digest.clone();
    let own = core.info.recipe.clone().unwrap();
    assert_eq!(own.block_size as usize, model::BLOCK_POSITIONS);
    type Change = fn(&mut CacheRecipe);
    let changes: [(&str, Change); 5] = [
        ("n_ctx", |r| r.n_ctx += 1),
        ("block_size", |r| r.block_size *= 2),
        ("kv_dtype", |r| r.kv_dtype = "q8_0".into()),
        ("rope_base", |r| r.rope_base *= 2.0),
        ("layer_end", |r| r.layer_end -= 1),
    ];
    for (field, change) in changes {
        let mut expected = own.clone();
        change(&mut expected);
        let err = open_with(&core, 1, &digest, vec![expected], 0)
            .await
            .err()
            .expect("a different recipe is refused");
        assert!(
            err.message().contains("recipe_mismatch") && err.message().contains(field),
            "{field}: {}",
            err.message()
        );
    }
    // The recipe the shard describes is accepted.
    let mut route = open_with(&core, 1, &digest, vec![own], 0).await.unwrap();
    let r = route.step(1, vec![frag(1, 0, &[1, 2])], vec![]).await;
    assert!(r.errors.is_empty() && r.outputs.len() == 1);
}

/// A seam encoding the shard does not know is refused at setup, naming it (never read as f32);
/// each one it knows opens a route.
#[tokio::test]
async fn a_route_with_an_unknown_seam_encoding_is_refused_naming_it() {
    let core = core(64 << 20);
    let digest = core.info.model_digest.clone();
    for unknown in [3, -1, 1000] {
        let err = open_with(&core, 1, &digest, vec![], unknown)
            .await
            .err()
            .expect("an unknown seam encoding is refused");
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert!(
            err.message().contains(&format!("seam encoding {unknown}")),
            "{}",
            err.message()
        );
    }
    for known in [0, 1, 2] {
        let mut route = open_with(&core, 1, &digest, vec![], known).await.unwrap();
        let r = route.step(1, vec![frag(1, 0, &[1, 2])], vec![]).await;
        assert!(r.errors.is_empty() && r.outputs.len() == 1, "seam {known}");
    }
}

#[tokio::test]
async fn releasing_a_session_returns_kv_bytes_exactly_and_leaves_others_unchanged() {
    let core = core(64 << 20);
    let digest = core.info.model_digest.clone();
    let mut route = open(&core, 1, &digest).await.unwrap();
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|s| (0..6).map(|i| 20 + s * 7 + i).collect())
        .collect();
    let mut outs = Vec::new();
    for (s, p) in prompts.iter().enumerate().take(3) {
        outs.push(
            route
                .step(1, vec![frag(s as u64 + 1, 0, p)], vec![])
                .await
                .outputs[0]
                .token,
        );
    }
    let before = core.stats();
    assert_eq!(before.kv_blocks_in_use, 3, "one block per 6-token session");
    assert_eq!(
        before.kv_bytes_in_use,
        before.kv_blocks_in_use * before.kv_block_bytes
    );
    let r = route.step(1, vec![frag(4, 0, &prompts[3])], vec![]).await;
    assert_eq!(r.outputs.len(), 1);
    assert!(core.stats().kv_bytes_in_use > before.kv_bytes_in_use);
    // Release the fourth: KV goes back exactly to what it was before it started.
    route.step(1, vec![], vec![4]).await;
    assert_eq!(core.stats().kv_bytes_in_use, before.kv_bytes_in_use);
    assert_eq!(core.stats().kv_blocks_in_use, before.kv_blocks_in_use);
    assert_eq!(core.stats().sessions, 3);
    // The other three continue exactly as a fresh shard computes them alone.
    let fresh = self::core(64 << 20);
    let mut alone = open(&fresh, 1, &digest).await.unwrap();
    for (s, p) in prompts.iter().enumerate().take(3) {
        let id = s as u64 + 1;
        let next = route
            .step(1, vec![frag(id, 6, &[outs[s]])], vec![])
            .await
            .outputs[0]
            .token;
        alone.step(1, vec![frag(id, 0, p)], vec![]).await;
        let want = alone
            .step(1, vec![frag(id, 6, &[outs[s]])], vec![])
            .await
            .outputs[0]
            .token;
        assert_eq!(
            next, want,
            "session {id} changed after another was released"
        );
    }
    route.step(1, vec![], vec![1, 2, 3]).await;
    assert_eq!(core.stats().kv_bytes_in_use, 0);
    assert_eq!(core.stats().sessions, 0);
}

#[tokio::test]
async fn work_over_the_kv_budget_is_refused_with_the_numbers() {
    // Room for one block (16 positions) and a half: one 6-token session.
    let core = core(BLOCK_BYTES * 3 / 2);
    let digest = core.info.model_digest.clone();
    let mut route = open(&core, 1, &digest).await.unwrap();
    let r = route
        .step(
            1,
            vec![
                frag(1, 0, &[1, 2, 3, 4, 5, 6]),
                frag(2, 0, &[1, 2, 3, 4, 5, 6]),
            ],
            vec![],
        )
        .await;
    assert_eq!(r.outputs.len(), 1);
    assert_eq!(reasons(&r), vec![(2, "capacity".to_string())]);
    let msg = &r.errors[0].message;
    assert!(
        msg.contains("kv_budget on shard test-shard")
            && msg.contains("need")
            && msg.contains("free"),
        "{msg}"
    );
    // A refused new session is not kept.
    assert_eq!(core.stats().sessions, 1);
}

#[tokio::test]
async fn closing_the_route_stream_releases_its_sessions() {
    let core = core(64 << 20);
    let digest = core.info.model_digest.clone();
    let mut route = open(&core, 1, &digest).await.unwrap();
    route.step(1, vec![frag(1, 0, &[1, 2, 3])], vec![]).await;
    assert_eq!(core.stats().sessions, 1);
    drop(route);
    for _ in 0..100 {
        if core.stats().sessions == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(core.stats().sessions, 0);
    assert_eq!(core.stats().kv_bytes_in_use, 0);
}

/// Bytes one position of the tiny model costs: K and V, 4 layers, kv_dim 128, f16.
const PER_POSITION: usize = 2 * 4 * 128 * 2;
/// Bytes of one KV block.
const BLOCK_BYTES: usize = PER_POSITION * model::BLOCK_POSITIONS;

#[tokio::test]
async fn under_pressure_the_least_recently_used_idle_session_is_evicted_and_then_misses() {
    // Two blocks: two short sessions.
    let core = core(BLOCK_BYTES * 5 / 2);
    let digest = core.info.model_digest.clone();
    let mut route = open(&core, 1, &digest).await.unwrap();
    let t1 = route
        .step(1, vec![frag(1, 0, &[1, 2, 3, 4, 5, 6])], vec![])
        .await
        .outputs[0]
        .token;
    let t2 = route
        .step(1, vec![frag(2, 0, &[7, 8, 9, 10, 11, 12])], vec![])
        .await
        .outputs[0]
        .token;
    // Session 3 does not fit beside both: session 1, used least recently, makes room.
    let r = route
        .step(1, vec![frag(3, 0, &[13, 14, 15, 16, 17, 18])], vec![])
        .await;
    assert!(r.errors.is_empty(), "{:?}", r.errors);
    assert_eq!(core.stats().evictions, 1);
    assert_eq!(core.stats().sessions, 2);
    let r = route.step(1, vec![frag(1, 6, &[t1])], vec![]).await;
    assert_eq!(reasons(&r), vec![(1, "cache_miss".to_string())]);
    // Session 2 is untouched and continues.
    let r = route.step(1, vec![frag(2, 6, &[t2])], vec![]).await;
    assert!(r.errors.is_empty() && r.outputs.len() == 1);
}

#[tokio::test]
async fn sessions_idle_past_the_ttl_are_forgotten() {
    let core = core_with(64 << 20, Duration::from_millis(50));
    let digest = core.info.model_digest.clone();
    let mut route = open(&core, 1, &digest).await.unwrap();
    let t1 = route
        .step(1, vec![frag(1, 0, &[1, 2, 3])], vec![])
        .await
        .outputs[0]
        .token;
    tokio::time::sleep(Duration::from_millis(120)).await;
    route.step(1, vec![frag(2, 0, &[4, 5, 6])], vec![]).await;
    assert_eq!(core.stats().evictions, 1);
    let r = route.step(1, vec![frag(1, 3, &[t1])], vec![]).await;
    assert_eq!(reasons(&r), vec![(1, "cache_miss".to_string())]);
}

/// Sessions with the same prompt share the cached blocks of its full 16-position blocks: the
/// second computes only the rest and samples the same token, each block is counted once, a
/// session's own blocks stay its own, and release leaves the shared blocks idle (free room)
/// until a later session starts on them. A fragment naming a prefix this shard does not hold
/// is a cache miss.
#[tokio::test]
async fn sessions_with_a_shared_prompt_prefix_share_its_cached_blocks() {
    let core = core(64 << 20);
    let digest = core.info.model_digest.clone();
    let mut route = open(&core, 1, &digest).await.unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| 20 + (i * 7) % 50).collect();
    let first = route.step(1, vec![first_frag(1, &prompt)], vec![]).await;
    let after_one = core.stats();
    assert_eq!(after_one.kv_blocks_in_use, 3);
    assert_eq!(after_one.prefix_reused_tokens, 0);
    let second = route.step(1, vec![first_frag(2, &prompt)], vec![]).await;
    assert_eq!(second.outputs[0].token, first.outputs[0].token);
    let after_two = core.stats();
    // 32 positions taken from the cache, 8 computed into one block of its own.
    assert_eq!(after_two.prefix_reused_tokens, 32);
    assert_eq!(after_two.prefill_tokens - after_one.prefill_tokens, 8);
    assert_eq!(after_two.kv_blocks_in_use, 4);
    // Both continue as a fresh shard computes the prompt alone.
    let fresh = self::core(64 << 20);
    let mut alone = open(&fresh, 1, &digest).await.unwrap();
    let t = first.outputs[0].token;
    let want = {
        alone.step(1, vec![frag(9, 0, &prompt)], vec![]).await;
        alone.step(1, vec![frag(9, 40, &[t])], vec![]).await.outputs[0].token
    };
    for id in [1, 2] {
        let got = route.step(1, vec![frag(id, 40, &[t])], vec![]).await;
        assert_eq!(got.outputs[0].token, want, "session {id}");
    }
    // Releasing both: nothing is held; the prompt's two full blocks stay idle.
    route.step(1, vec![], vec![1, 2]).await;
    let released = core.stats();
    assert_eq!(
        (released.kv_blocks_in_use, released.kv_bytes_in_use),
        (0, 0)
    );
    assert_eq!(released.kv_blocks_idle, 2);
    let third = route.step(1, vec![first_frag(3, &prompt)], vec![]).await;
    assert_eq!(third.outputs[0].token, t);
    assert_eq!(core.stats().prefix_reused_tokens, 64);
    assert_eq!(core.stats().kv_blocks_idle, 0);
    // A prompt in chunks: a chunk that does not sample may be taken whole from the cache
    // (nothing computed), and the next continues from there.
    assert_eq!(
        in_two_chunks(&core, &mut route, 6, &prompt, 32).await,
        (t, 32, 8)
    );
    // In chunks smaller than a block (a step's budget cut the first to 10 tokens): the first
    // ends inside a cached block, the next takes that block up again, and all 32 positions
    // still come from the cache.
    assert_eq!(
        in_two_chunks(&core, &mut route, 8, &prompt, 10).await,
        (t, 32, 8)
    );
    // A recomputation (no reuse asked) computes everything.
    let before = core.stats().prefill_tokens;
    route.step(1, vec![frag(4, 0, &prompt)], vec![]).await;
    assert_eq!(core.stats().prefill_tokens - before, 40);
    // A later shard told to start on a prefix it does not hold refuses with cache_miss.
    let other: Vec<u32> = (0..16).map(|i| 90 + i).collect();
    let missing = Fragment {
        prefix: other,
        ..frag(5, 16, &[7])
    };
    let r = route.step(1, vec![missing], vec![]).await;
    assert_eq!(reasons(&r), vec![(5, "cache_miss".to_string())]);
    // Positions from a prefix with nothing to compute cannot sample: refused, not run.
    let sampling_nothing = Fragment {
        prefix: prompt[..16].to_vec(),
        ..frag(7, 16, &[])
    };
    let r7 = route.step(1, vec![sampling_nothing], vec![]).await;
    assert_eq!(reasons(&r7), vec![(7, "invalid_request".to_string())]);
    assert!(
        r.errors[0].message.contains(
            "session 5 continues at position 0 with a 16-position prefix that is not cached"
        ),
        "{}",
        r.errors[0].message
    );
}

/// A session's fragment refused for the KV budget after it took cached blocks gives them back:
/// they were idle, free room for the step's other fragments, and a held block the refused
/// fragment never uses would leave those others planned on room that is gone.
#[tokio::test]
async fn a_fragment_refused_for_kv_gives_back_the_cached_blocks_it_took() {
    let budgets = core(64 << 20).info.budgets.unwrap();
    let block_bytes = budgets.kv_block_bytes as usize;
    let core = core(3 * block_bytes);
    let digest = core.info.model_digest.clone();
    let mut route = open(&core, 1, &digest).await.unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| 20 + (i * 7) % 50).collect();
    let r = route.step(1, vec![first_frag(1, &prompt)], vec![]).await;
    assert!(r.errors.is_empty(), "{r:?}");
    route.step(1, vec![], vec![1]).await;
    assert_eq!(
        (core.stats().kv_blocks_in_use, core.stats().kv_blocks_idle),
        (0, 2)
    );
    // Session 2 takes the prompt's first block from the cache...
    let head = Fragment {
        want_output: false,
        ..first_frag(2, &prompt[..16])
    };
    let r = route.step(1, vec![head], vec![]).await;
    assert!(r.errors.is_empty(), "{r:?}");
    assert_eq!(core.stats().kv_blocks_in_use, 1);
    // ... then asks for the second and 24 positions past the prompt: 4 blocks of a budget of 3.
    let long: Vec<u32> = prompt[16..].iter().copied().chain(0..24).collect();
    let tail = Fragment {
        reuse_prefix: true,
        ..frag(2, 16, &long)
    };
    let r = route.step(1, vec![tail], vec![]).await;
    assert_eq!(reasons(&r), vec![(2, "capacity".to_string())], "{r:?}");
    // It holds its first block, as before the step; the second is idle again.
    assert_eq!(
        (core.stats().kv_blocks_in_use, core.stats().kv_blocks_idle),
        (1, 1)
    );
}

/// Sends `prompt` as session `id`'s two chunks split at `at`, as the tracker does (the first
/// samples nothing, the second may continue on cached blocks): the token sampled, and the
/// positions the shard took from its cache and computed meanwhile.
async fn in_two_chunks(
    core: &ShardCore,
    route: &mut Route,
    id: u64,
    prompt: &[u32],
    at: usize,
) -> (u32, u64, u64) {
    let before = core.stats();
    let head = Fragment {
        want_output: false,
        ..first_frag(id, &prompt[..at])
    };
    let r = route.step(1, vec![head], vec![]).await;
    assert!(r.errors.is_empty() && r.outputs.is_empty(), "{r:?}");
    let tail = Fragment {
        reuse_prefix: true,
        ..frag(id, at as u32, &prompt[at..])
    };
    let r = route.step(1, vec![tail], vec![]).await;
    assert!(r.errors.is_empty(), "{r:?}");
    let after = core.stats();
    (
        r.outputs[0].token,
        after.prefix_reused_tokens - before.prefix_reused_tokens,
        after.prefill_tokens - before.prefill_tokens,
    )
}

/// A heavy grammar: calls of seven tools, each of 128 optional properties (tens of
/// milliseconds to compile and first mask).
fn heavy_grammar() -> String {
    let wide: serde_json::Map<String, serde_json::Value> = (0..128)
        .map(|i| (format!("p{i}"), serde_json::json!({"type": "integer"})))
        .collect();
    let tools: Vec<constrain::grammar::Tool> = (0..7)
        .map(|i| constrain::grammar::Tool {
            name: format!("tool_{i}"),
            parameters: serde_json::json!({"type": "object", "properties": wide}),
        })
        .collect();
    constrain::grammar::tool_calls(
        &tools,
        constrain::grammar::CallRules {
            lazy: false,
            parallel: true,
            format: constrain::grammar::CallFormat::Hermes,
        },
    )
    .unwrap()
}

/// On the last shard a grammar runs beside the forward pass: one not ready within the step's
/// grammar budget fails its own session, typed `grammar_budget` and naming the budget, while
/// the unconstrained session of the same step gets its token; with a budget to spare the same
/// grammar samples.
#[tokio::test]
async fn a_grammar_over_its_budget_fails_its_own_session_and_no_other() {
    let grammar = heavy_grammar();
    let constrained = |id| Fragment {
        sampling: Some(proto::v1::Sampling {
            grammar: grammar.clone(),
            n_prompt: 3,
            ..Default::default()
        }),
        ..frag(id, 0, &[5, 6, 7])
    };
    let tight = ShardCore::load(ShardConfig {
        grammar_budget: Duration::from_millis(1),
        ..config(1 << 20, Duration::from_secs(600))
    })
    .unwrap();
    let digest = tight.info.model_digest.clone();
    let mut r = open(&tight, 1, &digest).await.unwrap();
    let reply = r
        .step(1, vec![constrained(1), frag(2, 0, &[5, 6, 7])], vec![])
        .await;
    let ids: Vec<u64> = reply.outputs.iter().map(|o| o.session_id).collect();
    assert_eq!(ids, [2], "{reply:?}");
    assert_eq!(reply.errors.len(), 1, "{reply:?}");
    let e = &reply.errors[0];
    assert_eq!((e.session_id, e.kind().name()), (1, "grammar_budget"));
    assert!(e.message.contains("`grammar_budget_ms`"), "{}", e.message);
    // The next step of the unconstrained session goes on.
    let token = reply.outputs[0].token;
    let reply = r.step(1, vec![frag(2, 3, &[token])], vec![]).await;
    assert_eq!(reply.outputs.len(), 1, "{reply:?}");

    let roomy = ShardCore::load(ShardConfig {
        grammar_budget: Duration::from_secs(60),
        ..config(1 << 20, Duration::from_secs(600))
    })
    .unwrap();
    let mut r = open(&roomy, 1, &digest).await.unwrap();
    let reply = r
        .step(1, vec![constrained(1), frag(2, 0, &[5, 6, 7])], vec![])
        .await;
    assert!(reply.errors.is_empty(), "{reply:?}");
    assert_eq!(reply.outputs.len(), 2, "{reply:?}");
}

/// A route from a peer on another protocol version is refused, typed, naming both versions;
/// a refused recipe is typed too (the reason is in the status's details, not its text).
#[tokio::test]
async fn a_peer_on_another_protocol_version_is_refused_typed() {
    let core = core(64 << 20);
    let (tx, rx) = mpsc::channel(8);
    let setup = RouteSetup {
        protocol_version: 4,
        epoch: 1,
        model_digest: core.info.model_digest.clone(),
        ..Default::default()
    };
    tx.send(RouteMsg {
        msg: Some(route_msg::Msg::Setup(setup)),
    })
    .await
    .unwrap();
    let err = LocalShard::new(Arc::clone(&core))
        .route(rx)
        .await
        .err()
        .expect("an old peer is refused");
    let r = proto::status_refusal(&err).expect("a typed refusal");
    assert_eq!(r.reason, engine::Reason::ProtocolMismatch);
    assert_eq!(r.limit.as_deref(), Some("protocol_version"));
    let five = proto::PROTOCOL_VERSION.to_string();
    assert!(
        r.message.contains(" 4,") && r.message.contains(&five),
        "{}",
        r.message
    );
    let wrong = open(&core, 1, "not-this-model").await.err().unwrap();
    let r = proto::status_refusal(&wrong).expect("a typed refusal");
    assert_eq!(r.reason, engine::Reason::RecipeMismatch);
}

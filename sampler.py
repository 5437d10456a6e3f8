"""GRAFT sampler and log-prob path: a hand-written batched sampler and a chunked log-prob for any causal LM.

What this file does
-------------------
Every log-probability in GRAFT (behaviour policy at sampling time, current policy in the loss, the compatibility
score of the paper's Eqs. 6-8) is ``log softmax(head(h @ W.T) / temperature)[target]`` where ``h`` is the model's
final hidden state, ``W`` its lm_head matrix and ``head`` the output transform of the model's forward (identity for
most models; departure 1). This file computes that quantity in two places that must agree:

* ``sample`` draws responses token by token and records the log-prob of each drawn token (behaviour log-probs);
* ``response_logprobs`` recomputes the same log-probs with one forward pass over prompt + response (training and
  compatibility), through ``token_logprobs``, which never materialises the (N, V) float32 logits (with grad it
  keeps them in the matmul's dtype for the backward, departure 15).

It imports torch, transformers' KV-cache classes and tqdm only; nothing of GRAFT's, so it can be copied alone.

API
---
``token_logprobs(hidden, weight, targets, *, temperature=1.0, logit_scale=1.0, softcap=None, chunk_size=1024,
               vocab_chunk_size=None, save_logits=None) -> (N,) float32``
    hidden (N, H) any float dtype, weight (V, H), targets (N,) long. log p(target) at the given temperature, the logits
    scaled by ``logit_scale`` and then soft-capped to softcap * tanh(z / softcap) when ``softcap`` is set, computed in
    float32 tiles of ``chunk_size`` tokens x ``vocab_chunk_size`` vocabulary rows, the log-sum-exp put together from
    the tiles' maxima and sums; the backward reuses the raw logits the forward kept in the matmul's dtype
    (``save_logits``, departure 15) or recomputes them. Differentiable w.r.t. hidden and weight. (float64 inputs
    give float64 log-probs.)
``response_logprobs(model, prompts, responses, *, pad_token_id, temperature=1.0, chunk_size=1024, share_prefix=True)
-> (logp, mask)``
    logp (B, T) float32 and mask (B, T) bool, T = longest response; logp[i, t] = log p(responses[i][t] | prompts[i] +
    responses[i][:t]), 0 where mask is False. Differentiable w.r.t. the model's parameters when grad is enabled.
``batches_by_length(prompts, responses, size, *, share_prefix=True) -> list[list[int]]``
    row indices cut into micro-batches of at most ``size`` rows for ``response_logprobs``, rows of similar lengths
    together, so that each micro-batch pads little (departure 14).
``Rollout(tokens, logprobs, ended_with_eos, stop=None)``
    one sampled response: token ids (EOS included when it stopped at EOS; the token that completed the stop string
    when it stopped on one), (len(tokens),) float32 CPU log-probs; ``finish`` says how it ended: "eos", "stop" or
    "length".
``sample(model, prompts, *, max_new_tokens, temperature=1.0, top_p=1.0, eos_token_id, pad_token_id=None,
         generator=None, max_batch_size=None, min_refill=None, static="auto", share_prefix=True, stop_strings=None,
         tokenizer=None, progress=False, stats=None, max_cache_bytes=None, sync_every=8, cast_once=True,
         block_size=16, attention="auto")``
    -> list[Rollout] in prompt order. Batched autoregressive sampling with a KV cache and continuous batching: at
    most ``max_batch_size`` rows in flight (on the static path also at most what ``max_cache_bytes`` holds by the
    rows' real lengths); rows that finish (EOS, a stop string, the cap) leave the batch and waiting prompts take
    their places.
``resolve_static(static, model, device) -> True | "auto" | False``
    which decode path ``sample`` takes for ``static`` ("auto", "on", "off") on this model and device (departure 10).
``with cast_weights_once(model, device) as nbytes:``
    under autocast, the model's float32 nn.Linear weights served as autocast-dtype copies for the block (departure
    17); nbytes: the copies' bytes (plan.py counts them).
``paged_attention(query, k_pool, v_pool, table, lengths, *, scale, block_size) -> (R, H, d)``
    one query token per slot attending over its own ``lengths`` columns of a paged pool (N, h, d), read in place
    through the block table (R, nb) by a Triton kernel (departure 18); ``paged_attention_reference`` the same in
    plain PyTorch. ``resolve_attention(attention, model, device)`` which one the static path takes, and why;
    ``paged_kernel_blocker(config)`` why a model family cannot take the kernel (None when it can).
``pool_plan(*, slots, length, expected, block_size, token_bytes, layers, budget, copies=1) -> PoolPlan | None``
    the static path's slots and KV blocks for a byte budget (departure 13), the rule ``sample`` applies; plan.py
    calls it so that the memory plan and the sampler cut the same pool. ``transient_copies(config)``: the copies of
    one layer's gathered K/V a static step holds at once (its ``copies``).

Departures and shortcuts (read these before copying)
----------------------------------------------------
1. The head is a bias-free linear map followed by the transform the model's forward applies, read from its config in
   one place (``_head``, table ``_HEAD_TRANSFORMS``, taken from each family's forward in transformers 5.x): logits =
   cap * tanh(s * (h @ W.T) / cap), with s Cohere's ``logit_scale`` (multiplied) or 1 / Granite's ``logits_scaling``
   (the model divides: one rounding apart, exact for Granite's powers of two) and cap the ``final_logit_softcapping``
   of Gemma-2, VaultGemma, nanochat and Gemma-3 (where set); the temperature divides the result, as generate applies
   it to the model's logits. The transform runs in float32 after the matmul (departure 3), where the model runs it
   in its own dtype. Any other head (a bias, or one of those fields set on a family not in the table) raises a
   ValueError naming the model class and the field, rather than silently giving log-probs that differ from
   ``generate``'s.
2. Log-probs of the sampled tokens are the temperature-scaled FULL-vocabulary log-probs, even when top-p truncates
   the distribution we sample from (that is what ``response_logprobs`` recomputes and the compatibility score
   uses). For temperature 0 (greedy) they are temperature-1 log-probs.
3. The logits matmul runs in the dtype ``hidden @ weight.T`` would run in at the call site, as the model's own
   lm_head would: the inputs' dtype, or autocast's (bf16) when ``token_logprobs`` is called under autocast with
   float32 tensors. That dtype is fixed when the forward runs and the backward recomputes its tiles in it with
   autocast switched off, so a ``loss.backward()`` outside the autocast block (as trainers write it) still sees
   probabilities that sum to 1. Everything after the matmul (temperature, log-sum-exp, softmax, gradient of the
   logits) is float32, and the weight gradient is accumulated over chunks in float32. On CPU, where bf16 matmuls
   are slow, pass float32 tensors. float64 inputs are computed and returned in float64 (the contract says float32;
   float64 is what ``gradcheck`` needs).
4. ``token_logprobs`` does not check that targets lie in [0, V) (that would need a host sync on every call);
   ``response_logprobs`` and ``sample`` check their Python inputs instead. A target outside the range (an ignore
   index such as -100) gives a meaningless log-prob and no error; with a zero upstream gradient there, as a masked
   loss gives it, it adds nothing to the gradients (tested).
5. ``sample`` switches the model to eval mode for the duration of the call (dropout off while sampling) and restores
   its previous mode afterwards. Its decode loop runs under ``torch.inference_mode`` (cheaper per op than
   ``no_grad``); the returned log-prob tensors are ordinary tensors.
6. Continuous batching. Finished rows are dropped from the KV cache (``DynamicCache.batch_select_indices``, one
   copy of the cache per step on which some row finishes), and leading columns that became padding in every row are
   cut. Waiting prompts are prefilled together, in one left-padded forward, and merged in by left-padding whichever
   cache is narrower: every row keeps its own positions and padding mask, so it computes what it would alone, up to
   float round-off of different batch shapes. A refill waits until ``min_refill`` slots are free (default 1/8 of
   ``max_batch_size``), trading a little occupancy for fewer prefill calls. Unlike vLLM-style engines this default
   path has no paged cache and no chunked prefill: a refill's prefill is its own forward call, and a row's cache is
   a stretch of a dense tensor (the static path pages its cache: departure 10). Sliding-window layers (Mistral,
   Gemma-2/3, Cohere-2, Qwen's max_window_layers) are supported: every row's tokens sit right-aligned and contiguous
   in the cache, so the model's own window over cache columns is each row's last W tokens, exactly what it sees
   alone; such a layer holds the last W - 1 columns of the batch
   (transformers' DynamicSlidingWindowLayer), and a merge pads, a trim slices, and both reset the columns it counts
   as seen to the batch's width. Models with any other kind of cache layer (chunked attention, recurrent state) run
   all prompts at once only, and their caches are never trimmed.
7. The random stream. One 62-bit seed per prompt is drawn from the caller's generator, in prompt order, at the
   start of the call; row i's t-th token is then drawn by inverting the (top-p truncated) CDF at the uniform
   splitmix64(seed_i + (t + 1) * golden), computed on the device. A row's response is therefore a function of its
   prompt, its seed and the model only: the same whatever its batch mates, ``max_batch_size``, ``static`` or the
   step at which it entered (tests check token identity across all of these). It differs from ``generate``'s
   ``torch.multinomial`` stream; greedy decoding uses no randomness and matches ``generate`` token for token. The
   CDF is inverted in two levels (float32 sums of blocks of 1,024 tokens, then a float64 cumulative sum inside the
   one block that holds the point), so each token's chance is its float32 probability to ~1e-7 relative, the
   round-off the probabilities carry anyway (53-bit uniforms), and top-p first looks for its nucleus
   among each row's 256 most likely tokens, sorting a row whole only when they hold less than top_p: a flat
   cumulative sum and a sort of 262k tokens per row were most of a Gemma-3 draw (``bench_sampler.py --only draw``).
   The drawn token's log-prob is z - max - log(sum exp(z - max)) with that sum in float64.
8. For SDPA models without sliding-window layers, a decode step's attention mask is handed to the model as a
   ready (B_alive, 1, 1, cur) boolean view of the preallocated padding mask (transformers passes 4D masks through
   untouched): one query attending to every cached column but the padding is exactly what its causal-mask builder
   would produce, minus the per-step cost. Other attention implementations get the 2D mask.
9. ``pad_token_id`` defaults to 0 in ``sample``: padding is masked out, so any id in [0, V) gives the same result.
10. The static path (``static="auto"``, the default, takes it on CUDA; ``"on"`` anywhere) with a paged KV cache. S slots
   each run one row (S = max_batch_size at most, departure 13); their K/V live in a pool: per layer ``blocks + 1``
   blocks of ``block_size`` (default 16) token rows of (kv_heads, head_dim), and a device block table (S, L /
   block_size) listing each slot's blocks in column order, L = longest prompt + max_new_tokens. A decode step draws
   every slot's next token, writes its K/V at row table[s, pos // bs] * bs + pos % bs of the pool, and hands each
   attention layer the slots' first W columns gathered through the table, (R, h, W, d), with the padding mask (R, 1, 1,
   W) (R and W below): its shapes never change, so on CUDA the whole step (the draw at any temperature with top-p = 1,
   the forward, the bookkeeping) is captured as a CUDA graph (``torch.cuda.CUDAGraph``) and replayed; with top-p < 1 the
   draw runs eagerly before the replay (its nucleus search may sort a row whole, on the host's word). W is a width
   bucket, L / 8, L / 4, L / 2 or L in whole blocks: the smallest that holds every running row's columns until the next
   host read, picked by the host there; and a step runs only the first R slots, R the smallest multiple of ceil(S / 8)
   that holds every occupied slot: at each read, rows in slots past the first (rows in flight) move into the free slots
   below (their block-table rows and per-slot state move, no K/V is copied), so a tail of few rows runs few slots. One
   graph per (R, W) pair used (at most 32; at most 8 with the kernel of departure 18, which has one W), all in one
   memory pool. The graphs are captured at each ``sample`` call (each rollout), not once per run: a graph holds the
   addresses of the K/V pool and of its own memory pool, and between rollouts the trainer frees both so that the update
   can use that memory (plan.py's phases); keeping the graphs would hold the K/V budget through the update. Engines that
   keep their graphs across training steps (vLLM's sleep mode) remap physical memory under the same virtual addresses
   (CUDA's virtual memory API): not built. The cost is one warm-up and capture per bucket used per rollout (not measured
   on a GPU). The host hands out blocks without reading the device
   (every running row grows by one column a step): at admission the prompt's columns + sync_every, and at each host read
   (departure 16) each running row's next sync_every columns, so a step never writes a column the host did not give a
   block; a row that leaves returns its blocks; free slots and the columns no row owns point at a trash block (masked
   out). A waiting prompt is admitted when a slot is free and the pool has its blocks (max_batch_size caps the slots,
   memory decides below it; the ``min_refill`` wait applies only while slots, not blocks, are what is short). When the
   top-ups cannot be served, the newest rows are preempted (vLLM's recompute preemption): their blocks freed, they go
   back to the front of the queue with the tokens they drew (one device read of those tokens), and on readmission are
   prefilled with prompt + those tokens and draw on from counter t = tokens drawn, so by departure 7 they draw the same
   tokens as if never preempted (up to float round-off of other batch shapes; tested); the earlier tokens' log-probs are
   the first pass's. The cost of a preemption is that prefix's recompute. The oldest row always fits (the pool holds one
   row at full length), so the loop always progresses. Refill prefills run eagerly (right-padded) and are copied into
   the rows' blocks.
   What the gathered attention costs (the CPU's path, and the GPU's where the kernel of departure 18 cannot run; not
   measured on a GPU: none was lent to this work). The gathered K/V is a transient copy, one
   layer at a time, of R x W x (bytes per token / layers), and transformers copies it to every query head (departure 13;
   ``stats["kv_gather_bytes"]`` at S x L, both paid out of max_cache_bytes). Per step the gather reads R x W columns of
   K/V from the pool in block_size-token pieces and writes them, and the attention reads the copy: about 3 x R x W x
   bytes per token of KV traffic, where a dense static cache (each slot a preallocated stretch of L columns, as
   gpt-fast's; ``bench.decode --baseline``) has the attention read S x L in place: 3x the bytes per slot and column (on
   CUDA transformers also copies K/V to every query head for sdpa with a mask, in both, so with 2 query heads per KV
   head, Qwen3-1.7B's, about 7 units against 5; transformers 5.25's sdpa folds the query heads instead for one query
   token, no copy: 3 against 1). What it buys is rows in flight by their real lengths instead of S x L
   reserved: on ``python -m bench.decode --only budget``'s long-tailed rollout (CPU) 1.3x the rows in flight of the
   dense cache at the same budget, 0.78x its decode steps (so 0.78x the weight reads) and 0.84x the K/V columns attended
   over the rollout (every row-step reads W, = L while some running row is near the cap; buckets cut R in the tail and W
   early in a rollout), so about 2.5x the attention's bytes, and at pair1's lengths, where the attention's bytes
   outweigh the weights', the rollout is projected to take longer per token than with the dense cache (bf16, an H200's
   bandwidth: arithmetic, not measured). The kernel of departure 18 reads each row's real columns once instead: 1 unit
   per real column, no gather, no transient in the budget.
   Supports full-attention models with sdpa or eager attention; "auto" takes the default path for the rest
   (sliding-window and hybrid models, flash-attention and flex kernels: ``resolve_static`` says why) and on CPU, where
   there is no graph and the static step's gathered attention costs more; "on" refuses them with a ValueError. On CPU
   the static step runs eagerly: tested there for parity with the default path and ``generate`` (waiting, preemption and
   both kinds of bucket included), the body a capture records is watched to dispatch no host read and no data-dependent
   shape, and the warm-up that precedes a capture is tested to leave the state as it found it; the capture itself and
   its speed are measured only by ``python -m bench.gpu`` on a GPU (not run on this work: see docs/RESULTS.md,
   Decoding on a GPU).
11. One prefill per prompt (``share_prefix=True``, the default). GRPO hands the sampler n copies of every prompt,
   each with its own seed. ``sample`` keys rows by their prompt ids, queues the copies of a prompt together and
   prefills each distinct prompt of a refill once; every copy gets its own copy of the prompt's cache rows (so the
   cache, the trims and the merges of departure 6 and the slots of departure 10 are exactly as without sharing) and
   draws from its own seed: the same tokens as ``share_prefix=False``, up to float round-off of other batch shapes.
   A prompt whose copies are split between refills stays prefilled (one cache row, or one slot's K/V) until its
   last copy is taken; grouping the queue bounds these to about one prompt at a time. ``response_logprobs`` runs the
   distinct prompts of a call once (left-padded, into a KV cache), then the responses, each layer reading its rows
   of that cache by indexing; gradients flow through the indexing into the prompt's forward, so they equal the per-row
   forward's (a sum over rows either way; tested against autograd of the unshared path). Not shared: models with
   other kinds of cache layers (departure 6), and ``response_logprobs`` under gradient checkpointing with grad
   enabled (transformers' checkpointed layers drop the cache). The saving is prompt compute and activations: the
   KV cache of every row still holds its prompt (a copy in the row's own blocks on the static path: its pool shares
   no block between rows, as vLLM's prefix caching would).
12. Stop strings (``stop_strings``, decoded with ``tokenizer``). A row ends at the first token after which its
   decoded response contains one of the strings, also when the string spans several tokens or ends inside the
   token; the row counts as ended, like EOS (it leaves the batch, a refill takes its slot), and its tokens keep
   that token (with any text it carries past the string), so the log-probs and an update cover exactly what was
   sampled and a policy learns to stop. ``Rollout.stop`` names the string (the one starting first in the text when
   two complete at once); the caller cuts the text its verifier reads before it. The text is the response alone,
   decoded as a trainer decodes it (special tokens skipped, no clean-up of spaces): a string is never matched
   across the prompt, as in vLLM, where ``generate``'s ``StopStringCriteria`` also matches one that starts in the
   prompt's last tokens (and in special tokens' text). The check is incremental and cheap: each step decodes, in
   one ``batch_decode``, only each running row's last k tokens that carry text, k = the longest string's UTF-8
   length + 1 (every such token adds at least one byte, so the window holds the whole of any string the new token
   completes, and an earlier occurrence would have stopped the row earlier); special tokens that the decode skips
   are left out of the window. The tokens reach the host with departure 16's regular read, every sync_every steps,
   not every step: the same transfer brings each running row's last sync_every tokens, and the host feeds them to
   the check in order; a row whose string completed inside that window ends at that token and its later draws are
   discarded, as after an EOS (the same tokens as a read every step, tested). Greedy rows are token-identical to
   ``generate(stop_strings=..., tokenizer=...)`` (tested on the architecture sweep with the real Qwen3, SmolLM3
   and Llama-3.2 tokenizers). Without stop strings none of this runs (``bench_sampler.py --only stop``).
13. The KV cache under autocast. A model with float32 weights run under autocast computes K and V in mixed dtypes (V
   from a bf16 matmul, K promoted back to float32 by a float32 q/k norm or RoPE table: Qwen3, Llama), and the attention
   (sdpa, or eager's matmuls) casts both to the autocast dtype anyway. ``sample`` therefore stores K and V in the
   autocast dtype whenever autocast is on for the model's device, in both paths: the same tokens and log-probs as
   caching the mixed dtypes (tested), at 2 bytes per element instead of 4 for K. ``stats["kv_bytes_per_token"]`` reports
   the bytes one token's K and V take in the cache, read from the stored tensors. ``max_cache_bytes`` is the static
   path's whole K/V bill (departure 10): the pool, (blocks + 1) x block_size x bytes per token (the trash block
   included), plus one layer's transient K/V at S slots and L columns: the gather and, for grouped-query attention,
   transformers' copy of it to every query head (``repeat_kv``, run by sdpa with a mask and by eager attention): c = 1 +
   heads / kv_heads copies (c = 1 without grouping; ``transient_copies``; 3 for Qwen3-1.7B), c x S x L x bytes per
   token / layers. With g = c x L x bytes per token / layers (one slot's share), B = block_size x bytes per token (one
   block) and w = ceil(L / block_size) (a row at full length): S = min(max_batch_size or the prompt count,
   (max_cache_bytes - (w + 1) B) // g, (max_cache_bytes - B) // (g + B ceil(e / block_size))), e = ceil(mean prompt) +
   ceil(max_new_tokens / 2) + sync_every (a row at expected lengths, as plan.py assumes): the pool holds S rows at
   expected lengths (every slot pays its transient whatever its row) and one row at full length; blocks =
   min((max_cache_bytes - S g) // B - 1, S w). A budget that holds no such S (below one row at full length) raises a
   ValueError under "on" and falls back to the default path under "auto". None: S = max_batch_size, blocks for every
   slot at full length. Rows in flight are then as many as the pool holds by their real lengths (each row holds
   ceil(min(prompt + drawn + sync_every, L) / block_size) blocks at most). The default path's cache grows with the rows
   and is bounded by ``max_batch_size`` only.
14. ``batches_by_length`` cuts micro-batches for ``response_logprobs``, which pads every row of a call to its
   longest: cut in rollout order, long-tailed RL responses pad to several times their real tokens. It counts the
   token positions each of three cuts would feed (``_pass_tokens``, padding and shared prompts as
   ``response_logprobs`` runs them) and returns the cheapest: rollout order; rows by prompt + response length,
   longest first; copies of a prompt together, prompts by their longest row (keeps the shared prefill where the
   lengths are narrow). Each row's log-probs are its own whatever its batch mates, up to float round-off of
   other batch shapes (tested), so only the padding changes.
15. ``token_logprobs`` keeps the raw logits for its backward when a gradient will be needed and the matmul runs in
   a 2-byte dtype (bf16 autocast, the GPU trainer; ``save_logits`` forces either way): (N, V) in that dtype, 2
   bytes a logit, against the naive path's ~10-12 (its bf16 logits, their float32 copy, the float32 log-softmax it
   saves, the float32 gradient). In float32 (the CPU's regime) kept logits would be 4 bytes a logit, a third of the
   naive path's peak (0.36x at N 2,048 x V 151,936, ``bench.sampler --only logprobs``), so there it recomputes.
   The backward writes each tile's gradient over its logits and frees them one vocabulary slice at a time, so a
   pass is three N x H x V matmuls, as the naive path's, where recomputing (``save_logits=False``) needs four; the
   rest is a few float32 passes over (chunk_size x slice) tiles, W cast to the matmul dtype once per pass a slice at
   a time (never once per tile), and ~1,000 aten calls at N 8,192 x V 151,936
   (``python -m bench.logprob``: ops, W casts, peak on fake tensors at that shape; 1.02x the naive time projected
   for an H200, 0.18x its peak above the inputs; a projection, not a GPU measurement). Without grad (the behaviour
   pass) nothing is kept. The first backward consumes the kept logits; a second one (``retain_graph``) recomputes
   them. The one-hot term of the gradient is added to each tile before its single rounding to the matmul dtype,
   as the naive path rounds g (onehot - p); the weight gradient of a slice is one matmul over all N rows when the
   logits are kept (a float32 sum of per-chunk bf16 products when recomputing, as before).

16. No host read inside a decode step. ``_Run.draw`` writes each drawn token and its log-prob into device buffers
   and records on the device when a row ends (EOS or the cap); the host reads which rows have ended in one
   device-to-host copy every ``sync_every`` = 8 steps (and when every row has drawn the cap), not every step. A
   row that ended keeps running until that read: up to sync_every - 1 wasted row-steps each, whose draws are never
   read (the buffers and each row's cache room hold max_new_tokens + sync_every columns). Refills, the static
   path's block top-ups, preemptions and width bucket wait for a read too (departure 10). With stop strings the same
   transfer brings each running row's tokens of the last sync_every steps, checked on the host (departure 12).
17. Sampling weights cast once. Under autocast with float32 weights (the trainer's regime on a GPU), every
   nn.Linear weight is cast to autocast's dtype once per ``sample`` call (``cast_weights_once``) and the layers read
   that copy. Under ``torch.inference_mode`` autocast caches no casts, so before this every decode step re-cast every
   weight (``python -m bench.decode`` counts the casts per step). The operands of every matmul are the same
   values as autocast's own casts, so tokens and log-probs are unchanged (tested); the price is a bf16 copy of the
   Linear weights for the duration of the call (plan.py's ``bf16 sampling copy`` term). Not refreshed after each
   optimizer step as a kept copy would be: the cast runs at each call, one pass over the weights per rollout.
18. Decode attention that reads the pool in place (``attention="auto"``, the default, takes it on CUDA). The gathered
   attention of departure 10 copies every slot's first W columns out of the pool, and transformers may copy them again
   to every query head (eager attention does; sdpa in transformers 5.25 folds the query heads instead); the kernel
   (``paged_attention``, Triton) instead runs one program per (slot, KV head) that walks the slot's blocks through
   the table up to its own length (read on the device: a captured graph serves any length) with an online softmax
   over 64-column tiles, for all the query heads that share the KV head. Each real
   column of K and V is read once; nothing is gathered, nothing repeated, no mask built, and the budget pays no
   transient (``copies`` = 0 in ``pool_plan``: more slots from the same bytes), so the width buckets are dropped
   (one graph per slot-count bucket). It is hooked in as a transformers attention function: registered in
   ``AttentionInterface`` as "graft_paged", the static step sets ``config._attn_implementation`` to that name for
   the length of its forward and hands the cache down in the forward's kwargs (``paged_kv``); ``update`` then
   returns the layer's pools, not a gather. Scores, the softmax and the accumulators are float32; the two products
   take the pool's dtype (bf16 on the GPU, the probabilities rounded to it before the second, as FlashAttention
   does; float32 pools in IEEE float32). Where it runs: model families checked in the architecture sweep
   (``_KERNEL_MODEL_TYPES``: their models pass kwargs down and their attention needs nothing the kernel lacks;
   ``paged_kernel_blocker`` says why not for the rest), Triton installed, on CUDA; "auto" first runs it once per
   process against ``paged_attention_reference`` on the device (``_kernel_checks_out``) and gathers if it fails to
   build or disagrees. Checked on CPU through Triton's interpreter (TRITON_INTERPRET=1): against the reference in
   float32 and float16 (the interpreter's bf16 matmul is broken; bf16 is left to the on-device check), and the static
   path with the kernel token-identical to the gathered path on the sweep, with preemption and buckets. Its speed is
   not measured: no GPU was lent to this work (``python -m bench.gpu`` times it). A long row in a tail of few rows
   runs as few programs (no split over columns, as flash-decoding would): the tail's steps are few.

Benchmark
---------
``python -m bench.sampler [--quick]`` prints peak memory, time and error of ``token_logprobs`` against the naive
full-logits path (also under bf16 autocast), the tokens/s of ``sample`` against transformers' ``generate``, and, on
long-tailed lengths, the model forward calls and tokens/s of continuous batching against chunks of 64 (README,
Benchmarks). ``python -m bench.sampler --only prefill`` measures departure 11: a GRPO rollout (G prompts x 8) and
its behaviour log-probs with and without ``share_prefix``, on the tiny models and on two real ones.
``python -m bench.sampler --only stop --baseline OLD/sampler.py`` measures departure 12: rollouts without stop
strings against the copy before stop strings existed, side by side, and what a stop-string check costs per step.
``python -m bench.logprob [--baseline OLD/sampler.py]`` measures departure 15 without a GPU: aten ops, W casts and
peak memory of ``token_logprobs`` (kept and recomputed logits) beside the naive path and another copy, on fake
tensors at the H200 row's shape, a roofline projection of GPU time, and CPU time at a small shape (direction only);
``python -m bench.gpu --only kernel`` times it on a GPU.
``python -m bench.decode`` measures departures 10, 16 and 17 on the host: one decode step at real depth and toy
width (ms, aten ops, weight casts, host reads per step), default path vs static (paged) vs ``generate``; and rows in
flight at one byte budget on a long-tailed length distribution, the dense static cache's count against the paged
pool's (``--only budget``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, get_layer_types_and_kwargs

try:  # the static path's paged decode kernel (departure 18); without Triton (a CPU-only install) it gathers instead
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None

__all__ = ["token_logprobs", "response_logprobs", "batches_by_length", "sample", "resolve_static",
           "cast_weights_once", "Rollout", "paged_attention", "paged_attention_reference", "resolve_attention",
           "paged_kernel_blocker", "pool_plan", "transient_copies"]


# ------------------------------------------------------------------------------------------------
# Chunked log-prob of target tokens: log_softmax(h @ W.T / T)[target] without ever holding (N, V) logits
# ------------------------------------------------------------------------------------------------

# When the caller does not choose a vocabulary slice, a (tokens x vocab) tile holds at most this many float32 logits
# (2**24 = 64 MiB). Every tile costs a few host-side op launches, and on a GPU those launches, not the arithmetic,
# set the pace of small tiles (an H200 measured a kernel of 2**23-logit tiles with per-tile W casts at 3.1x the naive
# path); at this size a pass over N 8,192 x V 151,936 is 80 tiles, each a few hundred microseconds of GPU work,
# while the few fp32 tiles alive at once stay a small fraction of the naive path's (N, V) float32 copies.
_TILE_ELEMENTS = 2**24

_PLAIN = (1.0, 1.0, None)  # (temperature, logit_scale, softcap) of a plain head: no float32 transform of the tile


def _vocab_chunk(n_tok: int, vocab_size: int, chunk_size: int, vocab_chunk_size: int | None) -> int:
    """Vocabulary rows per slice: the caller's choice, else as many as keep a (rows, slice) tile under budget."""
    if vocab_chunk_size is not None:
        assert vocab_chunk_size > 0, f"vocab_chunk_size must be positive, got {vocab_chunk_size}"
        return vocab_chunk_size
    rows = max(1, min(n_tok, chunk_size))  # a short call gets the whole vocabulary in one slice
    return max(1, min(vocab_size, _TILE_ELEMENTS // rows))


def _head_transform_(z: torch.Tensor, logit_scale: float, softcap: float | None) -> torch.Tensor:
    """The model head's output transform, in place on float32 (float64) logits z = h @ W.T: z * logit_scale, then
    softcap * tanh(z / softcap) when softcap is set. The same ops in the same order as the models' forwards (Cohere's
    ``logits * logit_scale``, Gemma-2's ``tanh(logits / cap) * cap``), and the one function both the kernel and the
    sampler use, so their logits round alike. A plain head (1.0, None) costs nothing."""
    if logit_scale != 1.0:
        z = z.mul_(logit_scale)
    if softcap is not None:
        z = z.div_(softcap).tanh_().mul_(softcap)
    return z


def _transformed(z: torch.Tensor, head: tuple, adt: torch.dtype) -> torch.Tensor:
    """A new (r, v) tensor in adt: the head's transform of the raw tile z (r, v), then divided by the temperature
    (generate's order: the model's logits, then the temperature). z is left as it is (it may be a saved tile)."""
    temperature, logit_scale, softcap = head
    zf = z.to(adt, copy=True)  # (r, v)
    zf = _head_transform_(zf, logit_scale, softcap)
    if temperature != 1.0:
        zf = zf.div_(temperature)  # division, not multiplication by 1/T, so it rounds as `logits / T` does in sample
    return zf


def _slice_cols(col: torch.Tensor, width: int, vocab_chunk: int) -> torch.Tensor:
    """Each row's target column in a slice of ``width`` <= vocab_chunk columns: col (N, 1) is the target's column in
    its own slice; clamped for a narrower (last) slice, so that every index is valid where the target lies
    elsewhere (the values read or written there are then discarded or zero)."""
    return col if width == vocab_chunk else col.clamp(max=width - 1)  # (N, 1)


# Devices whose mixed-dtype elementwise ops (bf16 - float32, or a float32 product written to bf16) are slower than
# a cast and a same-dtype op: on CPU they go through an unvectorised path (the promoted sub ~4x the two passes at
# 1,024 x 32,768, profiled for bench.logprob); on a GPU the kernel converts as it reads, one pass.
_SLOW_MIXED_DTYPES = {"cpu"}


def _sub_in(z: torch.Tensor, c: torch.Tensor, adt: torch.dtype) -> torch.Tensor:
    """A new (r, v) tensor z - c in adt, z (r, v) in any float dtype, c (r, 1) in adt: one promoted pass, or a cast
    first where that is faster (_SLOW_MIXED_DTYPES)."""
    if z.dtype != adt and z.device.type in _SLOW_MIXED_DTYPES:
        return z.to(adt).sub_(c)
    return torch.sub(z, c)


def _tile_forward(z: torch.Tensor, col: torch.Tensor, head: tuple, adt: torch.dtype,
                  scratch: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile's share of the log-sum-exp. z (r, v) raw logits h @ W.T in the compute dtype, col (r, 1) ->
    (max, sum of exp(z' - max), z' at col), each (r, 1), in adt (z' at col: in z's dtype for a plain head), with
    z' = head(z) / T the tile's logits. scratch: z is not kept, so a float32 tile may be worked on in place."""
    if head == _PLAIN:
        m = z.amax(1, keepdim=True).to(adt)  # (r, 1): exact, the max of bf16 values is one of them
        zt = z.gather(1, col)  # (r, 1) the target logit, read from the same values the normaliser uses (in z's dtype)
        # (r, v) z.float() - m; in place where allowed: a fresh 64 MiB tile per step costs page faults on CPU
        e = z.sub_(m) if scratch and z.dtype == adt else _sub_in(z, m, adt)
    else:
        e = _transformed(z, head, adt)  # (r, v)
        m = e.amax(1, keepdim=True)  # (r, 1)
        zt = e.gather(1, col)  # (r, 1)
        e = e.sub_(m)
    return m, e.exp_().sum(1, keepdim=True), zt


def _tile_backward_(z: torch.Tensor, lse: torch.Tensor, neg_g: torch.Tensor, col: torch.Tensor, hit: torch.Tensor,
                    head: tuple, adt: torch.dtype) -> None:
    """Overwrite the raw logits tile z (r, v) with the gradient of sum_i g_i logp_i w.r.t. it, in z's dtype.

    With z' = head(z) / T and p = exp(z' - lse): d logp_i / d z'_ij = 1[j = t_i] - p_ij, so the gradient of the raw
    logits is g s / T (onehot - p) (1 - (c / cap)**2), c = z' T the capped logit, s the logit scale (departure 1).
    neg_g (r, 1) = -g s / T; hit (r, 1) = -1 where the row's target lies in this slice, else 0; col (r, 1) its column.
    """
    temperature, _, softcap = head
    dcap = None
    if head == _PLAIN:  # (r, v) z.float() - lse, then the softmax in place; a float32 tile is overwritten anyway
        p = z.sub_(lse).exp_() if z.dtype == adt else _sub_in(z, lse, adt).exp_()
    else:
        zf = _transformed(z, head, adt)  # (r, v)
        if softcap is not None:  # soft-cap derivative 1 - (c / cap)**2, read off the tile before zf is overwritten
            dcap = (zf * (temperature / softcap)).square_().neg_().add_(1.0)  # (r, v)
        p = zf.sub_(lse).exp_()  # (r, v)
    p = p.scatter_add_(1, col, hit)  # p - onehot(target) where the target lies in this slice
    if dcap is not None:
        p = p.mul_(dcap)
    # -g s / T (p - onehot) = g s / T (onehot - p), rounded once to the compute dtype as the naive path's
    # gradient of `logits.float()` is, and written over the logits the tile no longer needs
    if p is z:
        z.mul_(neg_g)
    elif z.dtype != adt and z.device.type in _SLOW_MIXED_DTYPES:
        z.copy_(p.mul_(neg_g))  # (same values: one float32 product, one rounding)
    else:
        torch.mul(p, neg_g, out=z)


def _add_matmul(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b, acc float32 (or float64): fused in place when a, b share its dtype, else their product is added."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(torch.mm(a, b))


class _TokenLogprobs(torch.autograd.Function):
    """Autograd function behind ``token_logprobs``; see there for shapes. Saves the (N,) log-sum-exp, and the raw
    logits tiles in the compute dtype when ``save`` (departure 15)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, head, chunk_size, vocab_chunk, cdt, save):
        # head: (temperature, logit_scale, softcap). cdt: the dtype both matmul operands are brought to, fixed by
        # token_logprobs before autograd runs, so the forward and the backward (which may run under another autocast
        # state, or none) compute the same tiles
        with torch.autocast(hidden.device.type, enabled=False):
            return _TokenLogprobs._forward(ctx, hidden, weight, targets, head, chunk_size, vocab_chunk, cdt, save)

    @staticmethod
    def _forward(ctx, hidden, weight, targets, head, chunk_size, vocab_chunk, cdt, save):
        # Vocabulary slices outside, rows inside: each slice of W is cast to the compute dtype once per pass (never
        # once per tile), and each tile's max, sum of exponentials and target logit are kept per (slice, row); the
        # log-sum-exp is put together from them once, after the last slice.
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        adt = torch.promote_types(cdt, torch.float32)  # softmax arithmetic: float32, float64 only for float64 inputs
        n_slices = -(-vocab // vocab_chunk)
        h = hidden.to(cdt)  # (N, H), cast once per pass
        slot = torch.div(targets, vocab_chunk, rounding_mode="floor")  # (N,) the slice holding each target
        col = (targets - slot * vocab_chunk).unsqueeze(1)  # (N, 1) its column there
        group = max(n_tok, 1) if save else chunk_size  # rows per matmul: all of them when the tiles are kept
        h_groups = h.split(group)  # views made once per pass: every slice, every tile is a host-side call on a GPU
        blocks, maxes, sums, tgts = [], [], [], []
        for v0 in range(0, vocab, vocab_chunk):
            w = weight[v0 : v0 + vocab_chunk].to(cdt)  # (v, H)
            cols = iter(_slice_cols(col, w.shape[0], vocab_chunk).split(chunk_size))  # (r, 1) per tile, in row order
            for h_g in h_groups:
                z = torch.mm(h_g, w.t())  # (g, v) raw logits in the compute dtype
                if save:
                    blocks.append(z)
                for z_tile in z.split(chunk_size):  # (r, v); a group is a whole number of tiles
                    m, s, zt = _tile_forward(z_tile, next(cols), head, adt, scratch=not save)
                    maxes.append(m)
                    sums.append(s)
                    tgts.append(zt)
        if n_tok == 0:
            lse = torch.zeros(0, 1, dtype=adt, device=hidden.device)  # (0, 1)
            logp = torch.zeros(0, dtype=adt, device=hidden.device)  # (0,)
        else:
            mx = torch.cat(maxes).view(n_slices, n_tok, 1)  # (S, N, 1): tiles were appended slice-major, rows in order
            top = mx.amax(0)  # (N, 1)
            lse = top + torch.log((torch.cat(sums).view(n_slices, n_tok, 1) * torch.exp(mx - top)).sum(0))  # (N, 1)
            # clamped: a target outside [0, V) (an ignore index such as -100) reads some logit instead of indexing
            # out of range (a device-side assert on CUDA); its value is garbage, its one-hot term absent (departure 4)
            where = slot.clamp(0, n_slices - 1).view(1, n_tok, 1)  # (1, N, 1)
            tgt = torch.cat(tgts).view(n_slices, n_tok, 1).gather(0, where)  # (1, N, 1)
            tgt = tgt.view(n_tok, 1).to(adt)  # (N, 1); plain heads gathered the compute dtype's values
            logp = (tgt - lse).view(n_tok)  # (N,)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.cfg = (head, chunk_size, vocab_chunk, cdt)
        ctx.blocks = blocks if save else None  # (S x (N, v)) raw logits; consumed by the first backward
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        # The caller's backward usually runs outside the autocast block its forward ran in (loss.backward() after
        # `with autocast: loss = ...`): autocast is switched off here and the tiles are recomputed in the dtype the
        # forward used, so that exp(z - lse) sums to 1 over the vocabulary (departure 3).
        with torch.autocast(grad_logp.device.type, enabled=False):
            return _TokenLogprobs._backward(ctx, grad_logp)

    @staticmethod
    def _backward(ctx, grad_logp):
        # Per vocabulary slice: every tile's gradient of the raw logits (_tile_backward_) is written over the saved
        # logits (or over a recomputed tile), then two matmuls: the slice's rows of grad_W, and its share of grad_h.
        # With saved logits a slice's matmuls run over all N rows at once, so grad_W's rows are one matmul each, as
        # in the naive path, and the saved tiles are freed slice by slice as they are used.
        hidden, weight, targets, lse = ctx.saved_tensors
        head, chunk_size, vocab_chunk, cdt = ctx.cfg
        blocks, ctx.blocks = ctx.blocks, None  # overwritten below: a second backward (retain_graph) recomputes
        temperature, logit_scale, _ = head
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n_tok, vocab = hidden.shape[0], weight.shape[0]
        adt = lse.dtype  # float32 (float64 for float64 inputs)
        h = hidden.to(cdt)  # (N, H), cast once per pass
        g = grad_logp.to(adt) / temperature  # (N,)
        neg_g = (g * logit_scale if logit_scale != 1.0 else g).neg().unsqueeze(1)  # (N, 1) = -g s / T
        slot = torch.div(targets, vocab_chunk, rounding_mode="floor")  # (N,)
        col = (targets - slot * vocab_chunk).unsqueeze(1)  # (N, 1)
        minus_one, zero = torch.tensor(-1.0, dtype=adt, device=hidden.device), torch.zeros((), dtype=adt,
                                                                                            device=hidden.device)
        grad_h = torch.zeros(hidden.shape, dtype=adt, device=hidden.device) if need_h else None  # (N, H)
        # float32 accumulator for the weight gradient when several row groups add into a slice (no saved tiles)
        grad_w = torch.empty(weight.shape, dtype=adt, device=weight.device) if need_w else None  # (V, H)
        group = max(n_tok, 1) if blocks is not None else chunk_size
        h_groups, lses, negs = h.split(group), lse.split(chunk_size), neg_g.split(chunk_size)  # views made once
        gh_groups = grad_h.split(group) if need_h else None
        for k, v0 in enumerate(range(0, vocab, vocab_chunk)):
            w = weight[v0 : v0 + vocab_chunk].to(cdt)  # (v, H)
            cols = _slice_cols(col, w.shape[0], vocab_chunk).split(chunk_size)  # (r, 1) per tile
            hits = torch.where(slot.unsqueeze(1) == k, minus_one, zero).split(chunk_size)  # (r, 1) per tile
            if need_w and n_tok == 0:
                grad_w[v0 : v0 + vocab_chunk].zero_()
            tile = 0
            for gi, h_g in enumerate(h_groups):
                z = blocks[k] if blocks is not None else torch.mm(h_g, w.t())  # (g, v)
                for z_tile in z.split(chunk_size):  # (r, v)
                    _tile_backward_(z_tile, lses[tile], negs[tile], cols[tile], hits[tile], head, adt)
                    tile += 1
                if need_w:
                    part = grad_w[v0 : v0 + vocab_chunk]  # (v, H)
                    if gi == 0 and z.dtype == adt:
                        torch.mm(z.t(), h_g, out=part)  # (v, H) = (v, g) @ (g, H)
                    elif gi == 0:
                        part.copy_(torch.mm(z.t(), h_g))  # one rounding to bf16, as the naive path's
                    else:
                        _add_matmul(part, z.t(), h_g)
                if need_h:
                    _add_matmul(gh_groups[gi], z, w)  # (g, H) += (g, v) @ (v, H)
            if blocks:  # (empty when N is 0)
                blocks[k] = None  # this slice's logits are spent: free them before the next slice's work
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)  # (N, H)
        grad_w = None if grad_w is None else grad_w.to(weight.dtype)  # (V, H); no copy for float32 weights
        return grad_h, grad_w, None, None, None, None, None, None


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int = 1024,
    vocab_chunk_size: int | None = None,
    save_logits: bool | None = None,
) -> torch.Tensor:
    """log_softmax(head(hidden @ weight.T) / temperature)[i, targets[i]] for every token i, in float32.

    head(z) = z * logit_scale, then softcap * tanh(z / softcap) when softcap is set: the output transform of the
    model's head (``_head`` reads it from a model's config). The defaults are a plain linear head.

    Args:
        hidden: (N, H) final hidden states, any float dtype (N flattened tokens, H hidden size).
        weight: (V, H) lm_head matrix (V vocabulary). May be the input embedding's Parameter (tied embeddings):
            autograd adds this function's gradient to the embedding's.
        targets: (N,) long token ids in [0, V) (not checked, departure 4).
        temperature: > 0; the head's logits are divided by it before the softmax.
        logit_scale: > 0, multiplies the logits (Cohere's ``logit_scale``; 1 / ``logits_scaling`` for Granite).
        softcap: None, or > 0: logits become softcap * tanh(logits / softcap) after the scaling (Gemma-2's
            ``final_logit_softcapping``).
        chunk_size: token rows per float32 tile.
        vocab_chunk_size: vocabulary rows per slice; None picks the whole vocabulary if a min(N, chunk_size) x V
            tile holds at most 2**24 logits, else the largest slice that does.
        save_logits: when a gradient will be needed, keep the raw (N, V) logits in the matmul's dtype for the
            backward instead of recomputing them (departure 15). None (default): keep them when that dtype has 2
            bytes (bf16 / fp16: autocast, the GPU trainer), recompute in float32 / float64 (the CPU's regime).
            True / False: always / never.

    Returns:
        (N,) float32 log-probabilities (float64 for float64 inputs, so that gradcheck can run). Differentiable w.r.t.
        hidden and weight; gradients come back in their dtypes.

    Memory and time: never more than a few (chunk_size, vocab slice) float32 tiles at once; the forward saves the
    (N,) log-sum-exp and, with ``save_logits`` and grad enabled, the (N, V) logits in the matmul dtype, which the
    backward overwrites with their gradient and frees slice by slice: three matmuls of N x H x V in all, as the naive
    path (four when recomputing). Without grad (the behaviour pass) nothing is kept. A soft-cap costs one tanh per
    logit in each pass and one more tile in the backward (its derivative).
    """
    assert hidden.dim() == 2 and weight.dim() == 2, f"hidden (N, H), weight (V, H); got {hidden.shape}, {weight.shape}"
    assert hidden.shape[1] == weight.shape[1], f"hidden size mismatch: hidden {hidden.shape}, weight {weight.shape}"
    assert targets.shape == hidden.shape[:1], f"targets must be (N,)={hidden.shape[:1]}, got {targets.shape}"
    assert hidden.is_floating_point() and weight.is_floating_point(), "hidden and weight must be floating point"
    assert temperature > 0, f"temperature must be > 0 for log-probs, got {temperature}"
    assert chunk_size > 0, f"chunk_size must be positive, got {chunk_size}"
    assert logit_scale > 0, f"logit_scale must be > 0, got {logit_scale}"
    assert softcap is None or softcap > 0, f"softcap must be None or > 0, got {softcap}"
    vocab_chunk = _vocab_chunk(hidden.shape[0], weight.shape[0], chunk_size, vocab_chunk_size)
    cdt = _matmul_dtype(hidden, weight)
    head = (float(temperature), float(logit_scale), None if softcap is None else float(softcap))
    keep = save_logits if save_logits is not None else torch.finfo(cdt).bits <= 16
    save = bool(keep) and torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _TokenLogprobs.apply(hidden, weight, targets.long(), head, int(chunk_size), vocab_chunk, cdt, save)


def _matmul_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the logits matmuls: what ``hidden @ weight.T`` would run in at the call site (departure 3).

    Under autocast that is autocast's dtype (bf16 / fp16 for float32 inputs, as the model's own lm_head would run);
    float64 is never cast (autocast leaves it alone too). Outside autocast it is the promoted input dtype."""
    dtype = torch.promote_types(hidden.dtype, weight.dtype)
    device = hidden.device.type
    if dtype != torch.float64 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return dtype


# ------------------------------------------------------------------------------------------------
# Model plumbing shared by response_logprobs and sample
# ------------------------------------------------------------------------------------------------


# How each model family's forward transforms lm_head(h), read off its modeling_<family>.py in transformers 5.x:
# config field -> "multiply" (logits * value), "divide" (logits / value) or "softcap" (tanh(logits / v) * v).
_HEAD_TRANSFORMS = {
    "cohere": {"logit_scale": "multiply"},
    "cohere2": {"logit_scale": "multiply"},
    "cohere2_moe": {"logit_scale": "multiply"},
    "granite": {"logits_scaling": "divide"},
    "granitemoe": {"logits_scaling": "divide"},
    "granitemoeshared": {"logits_scaling": "divide"},
    "granitemoehybrid": {"logits_scaling": "divide"},
    "gemma2": {"final_logit_softcapping": "softcap"},
    "gemma3_text": {"final_logit_softcapping": "softcap"},
    "vaultgemma": {"final_logit_softcapping": "softcap"},
    "nanochat": {"final_logit_softcapping": "softcap"},
}
# Config fields through which some transformers forward changes its logits after the lm_head matmul. A model whose
# family is not in _HEAD_TRANSFORMS for that field and sets one of them (to anything but None or 1) is refused: its
# forward may scale, divide or cap, and a guess would silently give log-probs that differ from generate's.
_HEAD_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "logits_soft_cap", "lm_head_multiplier",
                "output_multiplier")


@dataclass(frozen=True)
class _Head:
    """The model's head as this file computes it: logits = head(h @ weight.T), head(z) = z * logit_scale, then
    softcap * tanh(z / softcap) when softcap is set (departure 1). Read from the model by ``_head`` only."""

    weight: torch.Tensor  # (V, H) lm_head matrix
    logit_scale: float = 1.0
    softcap: float | None = None

    def kernel_kwargs(self) -> dict:
        """token_logprobs' head arguments; none for a plain head, so a plain head calls it as it always could."""
        if self.logit_scale == 1.0 and self.softcap is None:
            return {}
        return dict(logit_scale=self.logit_scale, softcap=self.softcap)


def _head(model) -> _Head:
    """The (V, H) lm_head matrix and the transform the model's forward applies to h @ W.T (departure 1). Anything
    but a bias-free linear map, scaled and soft-capped as _HEAD_TRANSFORMS lists, raises a ValueError."""
    name = type(model).__name__
    module = model.get_output_embeddings()
    if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor) or module.weight.dim() != 2:
        raise ValueError(f"sampler.py: {name} has no lm_head weight matrix (get_output_embeddings())")
    if getattr(module, "bias", None) is not None:
        raise ValueError(f"sampler.py: {name}'s lm_head has a bias; only logits = h @ W.T (scaled, soft-capped) is "
                         f"supported")
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    known = _HEAD_TRANSFORMS.get(getattr(cfg, "model_type", None), {})
    scale, softcap = 1.0, None
    for field in _HEAD_FIELDS:
        value = getattr(cfg, field, None)
        kind = known.get(field)
        if kind is None:
            if value is not None and value != 1:
                raise ValueError(f"sampler.py: {name} sets config.{field}={value!r}; sampler.py does not know how this "
                                 f"model's forward applies it to the logits, so it refuses rather than guess")
        elif value is not None:
            if not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"sampler.py: {name}: config.{field} must be a positive number, got {value!r}")
            if kind == "multiply":
                scale *= float(value)
            elif kind == "divide":
                scale /= float(value)  # one rounding away from the model's division; exact for powers of two
            else:
                softcap = float(value)
    return _Head(module.weight, scale, softcap)


def _base_model(model):
    """The transformer body that returns final hidden states (after the last norm), without the lm_head."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None or base is model:
        raise ValueError(f"sampler.py: cannot find the base model of {type(model).__name__} "
                         f"(base_model_prefix {model.base_model_prefix!r})")
    return base


def _cache_kwarg(base) -> str:
    """Name of the KV-cache argument: transformers 5.x renamed `past_key_values` to `cache`."""
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _head_layout(config) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim) of the decoder, from its config: what the KV cache's sizing, the static
    path's transient and the paged kernel's checks all read."""
    cfg = config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, getattr(cfg, "num_key_value_heads", None) or heads, head_dim


def _layer_windows(config) -> list[int | None] | None:
    """The attention span of each layer, as transformers lays out its DynamicCache for this config: None for full
    attention, W for a sliding window of W tokens (a query sees itself and the W - 1 tokens before it; the cache
    layer keeps the last W - 1). None instead of a list when some layer is of another kind (chunked attention,
    a recurrent state): the default path's trim and merge (departure 6) know these two kinds only."""
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    windows = []
    for kind, layer in zip(layer_types, DynamicCache(config=config).layers):  # empty layers: nothing allocated yet
        if kind == "full_attention" and type(layer) is DynamicLayer:
            windows.append(None)
        elif kind == "sliding_attention" and type(layer) is DynamicSlidingWindowLayer:
            windows.append(int(layer.sliding_window))
        else:
            return None
    return windows


def _as_id_list(seq) -> list[int]:
    """A token-id sequence (list or 1-D tensor) as a list of Python ints."""
    if isinstance(seq, torch.Tensor):
        assert seq.dim() == 1, f"token ids must be 1-D, got shape {tuple(seq.shape)}"
        return seq.tolist()
    return [int(x) for x in seq]


def _check_ids(rows: list[list[int]], vocab: int, what: str) -> None:
    """Token ids out of [0, V) would index garbage in token_logprobs (departure 4): refuse them here."""
    for i, row in enumerate(rows):
        if row and (min(row) < 0 or max(row) >= vocab):
            raise ValueError(f"{what}[{i}] has a token id outside [0, {vocab}): min {min(row)}, max {max(row)}")


def _prompt_keys(prompts: list[list[int]]) -> list[int] | None:
    """Per row, the index of the first row with the same prompt ids (departure 11); None when all are distinct."""
    first: dict[tuple[int, ...], int] = {}
    keys = [first.setdefault(tuple(p), i) for i, p in enumerate(prompts)]
    return None if len(first) == len(prompts) else keys


# ------------------------------------------------------------------------------------------------
# Log-probs of given responses: one forward pass to hidden states, then token_logprobs
# ------------------------------------------------------------------------------------------------


def _full_hidden(base, prompts, responses, pad_token_id: int, device) -> tuple[torch.Tensor, list[int]]:
    """The hidden states that predict every response token, (N, H) row-major, from one right-padded forward over
    prompt + response (all but its last token) per row; and the N target ids."""
    # Right padding: position ids are then the default arange, matching the per-row positions sample() uses.
    # The last response token predicts nothing we score, so it is not fed (saves one position per row).
    seqs = [p + r[:-1] for p, r in zip(prompts, responses)]
    n_rows, length = len(seqs), max(len(s) for s in seqs)
    input_ids = torch.full((n_rows, length), pad_token_id, dtype=torch.long)  # (B, L)
    attention_mask = torch.zeros(n_rows, length, dtype=torch.long)  # (B, L)
    rows, cols, targets = [], [], []
    for i, (s, p, r) in enumerate(zip(seqs, prompts, responses)):
        input_ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attention_mask[i, : len(s)] = 1
        rows += [i] * len(r)
        cols += range(len(p) - 1, len(p) - 1 + len(r))  # position len(p)-1+t predicts response token t
        targets += r
    hidden = base(
        input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), use_cache=False
    ).last_hidden_state  # (B, L, H)
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)  # (N,)
    cols_t = torch.tensor(cols, dtype=torch.long, device=device)  # (N,)
    return hidden[rows_t, cols_t], targets  # (N, H): only the positions that predict response tokens


def _read_only_rows(layer, index: torch.Tensor) -> None:
    """Make a filled cache layer (U rows) serve a B-row forward without growing: its ``update`` returns the rows
    ``index`` (B,) of the prompt's K/V followed by the new ones, and stores nothing, so each layer's (B, h, P + R, d)
    exists only while that layer runs (a stored cache would keep every layer's at once). A sliding layer still
    counts the new columns, as its own update would (transformers builds the masks before any layer runs)."""
    keys, values = layer.keys, layer.values  # (U, h, P', d): P' = P, or a sliding layer's last W - 1 columns

    def update(key_states, value_states, *args, **kwargs):
        if getattr(layer, "is_sliding", False):
            layer.cumulative_length += key_states.shape[-2]
        return torch.cat([keys[index], key_states], dim=-2), torch.cat([values[index], value_states], dim=-2)

    layer.update = update  # this call's own cache object: the instance attribute shadows the class's method


def _shared_prefix_hidden(base, config, prompts, responses, keys: list[int], pad_token_id: int,
                          device) -> torch.Tensor:
    """``_full_hidden``'s (N, H) with each distinct prompt run once (departure 11). keys: per row, the first row
    with its prompt (``_prompt_keys``).

    A left-padded forward over the U distinct prompts fills a KV cache; a second forward runs the responses (all
    but their last tokens, right-padded, at positions len(prompt) + t) on it, each layer reading its prompt's rows
    by indexing (``_read_only_rows``; autograd adds the copies' gradients back into the prompt's K/V, so the
    parameters' gradient is the per-row forward's up to float round-off: a sum over rows either way). Left padding
    keeps every row's prompt right-aligned and contiguous, so a sliding-window layer's last W - 1 cached columns
    are each row's last W - 1 prompt tokens, as in ``sample``."""
    uniq = list(dict.fromkeys(keys))
    at = {k: i for i, k in enumerate(uniq)}
    index = torch.tensor([at[k] for k in keys], dtype=torch.long)  # (B,) distinct prompt of each row
    lens = torch.tensor([len(prompts[k]) for k in uniq], dtype=torch.long)  # (U,)
    width = int(lens.max())
    ids = torch.full((len(uniq), width), pad_token_id, dtype=torch.long)  # (U, P)
    for i, k in enumerate(uniq):
        ids[i, width - lens[i] :] = torch.tensor(prompts[k], dtype=torch.long)
    prompt_mask = torch.arange(width).unsqueeze(0) >= (width - lens).unsqueeze(1)  # (U, P)
    positions = (torch.arange(width).unsqueeze(0) - (width - lens).unsqueeze(1)).clamp(min=0)  # (U, P)
    cache = DynamicCache(config=config)
    cache_arg = _cache_kwarg(base)
    last = base(
        input_ids=ids.to(device), attention_mask=prompt_mask.long().to(device), position_ids=positions.to(device),
        use_cache=True, **{cache_arg: cache},
    ).last_hidden_state[:, -1]  # (U, H): each prompt's last token, which predicts its responses' first
    index_dev = index.to(device)
    hidden = last[index_dev].unsqueeze(1)  # (B, 1, H)
    rest = max(len(r) for r in responses) - 1  # response tokens fed to the second forward, at most
    if rest > 0:
        for layer in cache.layers:
            _read_only_rows(layer, index_dev)
        r_ids = torch.full((len(responses), rest), pad_token_id, dtype=torch.long)  # (B, R)
        r_len = torch.tensor([max(len(r) - 1, 0) for r in responses], dtype=torch.long)  # (B,)
        for i, r in enumerate(responses):
            r_ids[i, : r_len[i]] = torch.tensor(r[: r_len[i]], dtype=torch.long)
        r_mask = torch.arange(rest).unsqueeze(0) < r_len.unsqueeze(1)  # (B, R)
        # position of response token t is len(prompt) + t; padding gets 0 (masked out, and inside any position table)
        r_pos = torch.where(r_mask, lens[index].unsqueeze(1) + torch.arange(rest).unsqueeze(0), 0)  # (B, R)
        attn = torch.cat([prompt_mask[index], r_mask], dim=1)  # (B, P + R)
        more = base(
            input_ids=r_ids.to(device), attention_mask=attn.long().to(device), position_ids=r_pos.to(device),
            use_cache=True, **{cache_arg: cache},
        ).last_hidden_state  # (B, R, H)
        hidden = torch.cat([hidden, more], dim=1)  # (B, 1 + R, H): column t predicts response token t
    rows = [i for i, r in enumerate(responses) for _ in r]
    cols = [t for r in responses for t in range(len(r))]
    return hidden[torch.tensor(rows, dtype=torch.long, device=device),
                  torch.tensor(cols, dtype=torch.long, device=device)]  # (N, H)


def _pass_tokens(prompts: list[list[int]], responses: list[list[int]], share: bool) -> int:
    """Token positions one ``response_logprobs`` call feeds the model body, padding included: B x the longest
    prompt + response[:-1] (``_full_hidden``), or, sharing (departure 11), U distinct prompts x the longest of them
    plus B x the longest response[:-1] (``_shared_prefix_hidden``). 0 when no response has a token."""
    if not any(responses):
        return 0
    if share and _prompt_keys(prompts) is not None:
        uniq = {tuple(p) for p in prompts}
        rest = max(len(r) for r in responses) - 1
        return len(uniq) * max(map(len, uniq)) + (len(responses) * rest if rest > 0 else 0)
    return len(prompts) * max(len(p) + max(len(r) - 1, 0) for p, r in zip(prompts, responses))


def batches_by_length(prompts, responses, size: int, *, share_prefix: bool = True) -> list[list[int]]:
    """Row indices in micro-batches of at most ``size`` rows for ``response_logprobs`` (departure 14): of three
    cuts, the one that feeds the fewest token positions (``_pass_tokens``, padding included): rollout order; rows
    by prompt + response length, longest first (copies of one prompt together among equal lengths); copies of
    each prompt together, prompts by their longest row. Every row appears once."""
    assert size >= 1, f"size must be >= 1, got {size}"
    prompts = [_as_id_list(p) for p in prompts]
    responses = [_as_id_list(r) for r in responses]
    assert len(prompts) == len(responses), f"{len(prompts)} prompts but {len(responses)} responses"
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    first: dict[tuple[int, ...], int] = {}
    key = [first.setdefault(tuple(p), i) for i, p in enumerate(prompts)]  # the first row with the same prompt
    longest: dict[int, int] = {}
    for i, k in enumerate(key):
        longest[k] = max(longest.get(k, 0), lengths[i])
    orders = [list(range(len(prompts))),
              sorted(range(len(prompts)), key=lambda i: (-lengths[i], key[i], i)),
              sorted(range(len(prompts)), key=lambda i: (-longest[key[i]], key[i], -lengths[i], i))]

    def cost(order: list[int]) -> int:
        return sum(_pass_tokens([prompts[i] for i in order[j: j + size]], [responses[i] for i in order[j: j + size]],
                                share_prefix) for j in range(0, len(order), size))

    best = min(orders, key=cost)  # ties: the earlier candidate (rollout order first)
    return [best[j: j + size] for j in range(0, len(best), size)]


def response_logprobs(
    model,
    prompts,
    responses,
    *,
    pad_token_id: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    share_prefix: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of each response given its prompt, from one right-padded forward pass (two when
    prompts repeat: each distinct prompt once, then the responses on its cache; departure 11).

    Args:
        model: a transformers causal LM (``*ForCausalLM``) with a plain lm_head (departure 1).
        prompts: B token-id lists (or 1-D LongTensors), each of length >= 1.
        responses: B token-id lists (or 1-D LongTensors), possibly empty.
        pad_token_id: id written into padding slots (they are masked out, any valid id works).
        temperature: logits are divided by it, as in ``sample``.
        chunk_size: tokens per chunk in ``token_logprobs``.
        share_prefix: run each distinct prompt once when prompts repeat (departure 11); the same values and
            gradients as False up to float round-off. Only for models whose layers all use full or sliding-window
            attention.

    Returns:
        logp: (B, T) float32, T = longest response; logp[i, t] = log p(responses[i][t] | prompts[i] +
            responses[i][:t]); 0 where mask is False. Differentiable w.r.t. the model when grad is enabled.
        mask: (B, T) bool, True on real response tokens.
    """
    prompts = [_as_id_list(p) for p in prompts]
    responses = [_as_id_list(r) for r in responses]
    assert len(prompts) == len(responses), f"{len(prompts)} prompts but {len(responses)} responses"
    assert all(len(p) > 0 for p in prompts), "every prompt needs a token: its last predicts the first response token"
    head = _head(model)
    weight, device = head.weight, head.weight.device
    _check_ids(prompts, weight.shape[0], "prompts")
    _check_ids(responses, weight.shape[0], "responses")
    n_rows = len(prompts)
    resp_len = [len(r) for r in responses]
    t_max = max(resp_len, default=0)
    mask = torch.arange(t_max).unsqueeze(0) < torch.tensor(resp_len, dtype=torch.long).unsqueeze(1)  # (B, T)
    mask = mask.to(device)
    if t_max == 0:
        # nothing to score: skip the forward pass (an all-empty batch would otherwise cost a full prompt pass)
        return torch.zeros(n_rows, 0, dtype=torch.float32, device=device), mask

    base = _base_model(model)
    # transformers' checkpointed layers drop the cache while grad is on, so that pass cannot continue a prompt's cache
    shareable = _layer_windows(model.config) is not None and not (
        torch.is_grad_enabled() and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()))
    keys = _prompt_keys(prompts) if share_prefix and shareable else None
    if keys is not None:
        h = _shared_prefix_hidden(base, model.config, prompts, responses, keys, pad_token_id, device)  # (N, H)
        targets = [t for r in responses for t in r]
    else:
        h, targets = _full_hidden(base, prompts, responses, pad_token_id, device)  # (N, H), N targets
    logp_flat = token_logprobs(
        h, weight, torch.tensor(targets, dtype=torch.long, device=device), temperature=temperature,
        chunk_size=chunk_size, **head.kernel_kwargs(),
    )  # (N,)
    # mask is row-major in the same order as the flattened tokens, so masked_scatter puts each value in its slot
    logp = torch.zeros(n_rows, t_max, dtype=logp_flat.dtype, device=device).masked_scatter(mask, logp_flat)  # (B, T)
    return logp, mask


# ------------------------------------------------------------------------------------------------
# Sampler, part 1: the random stream. Row i of a call draws its t-th token with a uniform that depends only on
# (seed_i, t), so a row's sample does not depend on its batch mates, the batch size or when it enters the batch
# ------------------------------------------------------------------------------------------------

# splitmix64 constants (Steele, Lea & Flood 2014) as signed int64: torch has no uint64 arithmetic, and int64
# multiplication and addition wrap modulo 2**64 on CPU and CUDA alike, which is all the mixer needs.
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic: it would copy the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _uniforms(seeds: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row from its seed and counter. seeds (B,) int64, counters (B,) int64 -> (B,) float64.

    The splitmix64 output function applied to seed + (counter + 1) * golden: a counter-based generator (no state to
    carry or reorder when rows leave or join the batch), 53 random bits per draw, the same bits on every device."""
    z = seeds + (counters + 1) * _GOLDEN  # (B,)
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 11).double() * 2.0**-53  # (B,) top 53 bits: exact in float64, strictly below 1


def _row_seeds(n_rows: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """(n_rows,) int64 seeds, drawn in prompt order from the caller's generator (torch's default one if None)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    return torch.randint(0, 2**62, (n_rows,), generator=generator, device=gen_device).to(device)  # (B,)


# Block width of the two-level inversion in _inverse_cdf, and the candidates top-p looks at before sorting a row's
# whole vocabulary (_nucleus). Both only set the cost; a row's token does not depend on them (up to float32
# round-off of the block sums at an interval's edge for the first, exactly for the second).
_CDF_BLOCK = 1024
_TOP_P_CANDIDATES = 256


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index drawn from each row's unnormalised weights by inversion. weights (B, V) float32 >= 0, u (B,) float64 in
    [0, 1) -> (index (B,) long, total (B,) float64 = the row's sum of weights).

    Two levels, so that no float64 CDF over the whole vocabulary is built: the sums of blocks of _CDF_BLOCK tokens
    (float32, pairwise within a block; a cumulative sum over the blocks in float64) locate the block that holds
    u * total, and a float64 cumulative sum inside that one block locates the token, the point rescaled from the
    block's float32 sum to that float64 one. Each token's chance is then its share of the weights to ~1e-7
    relative, the float32 round-off the weights themselves carry (a flat float64 CDF over 262k tokens, or float64
    block sums, cost several times the rest of a Gemma-3 draw; tested against the flat float64 inversion, which
    draws the same tokens but within ~1e-7 of an interval's edge). A zero-weight token is never drawn."""
    b, v = weights.shape
    full = v // _CDF_BLOCK * _CDF_BLOCK
    sums = [weights[:, :full].unflatten(1, (-1, _CDF_BLOCK)).sum(dim=-1)] if full else []  # (B, V // block)
    if full < v:  # the last, shorter block
        sums.append(weights[:, full:].sum(dim=-1, keepdim=True))
    mass = torch.cat(sums, dim=1).double()  # (B, nb) each block's weight
    cdf = mass.cumsum(dim=-1)  # (B, nb) cumulative weight up to the end of each block
    total = cdf[:, -1:]  # (B, 1)
    x = u.unsqueeze(1) * total  # (B, 1) the point to invert
    # first block whose cumulative weight exceeds x; u * total can round up to total, so never step past the last
    # block with positive weight (a block of zero weight never has cdf > x where its predecessor has cdf <= x)
    blk = torch.minimum(torch.searchsorted(cdf, x, right=True), (cdf < total).sum(dim=-1, keepdim=True))  # (B, 1)
    x = x - torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)), 0.0)  # (B, 1) >= 0: the point in the block
    cols = blk * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=weights.device)  # (B, block) the block's token ids
    inside = weights.gather(1, cols.clamp(max=v - 1)).masked_fill(cols >= v, 0.0).double().cumsum(dim=-1)  # (B, blk)
    x = x * (inside[:, -1:] / mass.gather(1, blk))  # (B, 1) onto the block's float64 running sum
    # x can still land on or past the block's end by round-off: never past its last token of positive weight
    j = torch.minimum(torch.searchsorted(inside, x, right=True), (inside < inside[:, -1:]).sum(dim=-1, keepdim=True))
    return cols.gather(1, j).squeeze(1), total.squeeze(1)  # (B,), (B,)


def _nucleus(weights: torch.Tensor, total: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p nucleus of each row in descending order: weights (B, V) unnormalised, total (B,) float64 their sums
    -> (kept (B, K) float32 probabilities, 0 past the row's nucleus; ids (B, K) long token ids), K <= V.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p: a token stays if the mass of the
    tokens strictly before it (in descending order) is still below top_p, so the most likely one always stays. It is
    looked for among each row's _TOP_P_CANDIDATES most likely tokens first (``topk``; sorting 262k tokens per row
    cost 40 times as much on Gemma-3), and a row whose candidates hold less than top_p is sorted whole. The running
    sums over the candidates are the first entries of the whole sort's, so both find the same nucleus (tokens of
    equal probability may come in another order; tested against sorting every row)."""
    v = weights.shape[1]
    probs, ids = weights.topk(min(_TOP_P_CANDIDATES, v), dim=-1)  # (B, K) sorted descending
    probs = probs / total.float().unsqueeze(1)  # (B, K)
    cum = probs.cumsum(dim=-1)  # (B, K)
    kept = probs.masked_fill(cum - probs >= top_p, 0.0)  # (B, K)
    if probs.shape[1] == v:
        return kept, ids
    wide = (cum[:, -1] < top_p).nonzero().squeeze(1)  # (R,) rows whose nucleus holds more than K tokens
    if len(wide) == 0:  # one host sync per step (the done check costs one already)
        return kept, ids
    p_all, id_all = weights[wide].sort(dim=-1, descending=True)  # (R, V)
    p_all = p_all / total[wide].float().unsqueeze(1)  # (R, V)
    p_all = p_all.masked_fill(p_all.cumsum(dim=-1) - p_all >= top_p, 0.0)  # (R, V)
    width = int((p_all > 0).sum(dim=-1).max())  # the widest nucleus (> K): the kept tokens are a prefix
    out_p, out_id = kept.new_zeros(len(kept), width), ids.new_zeros(len(ids), width)  # (B, width) each
    out_p[:, : kept.shape[1]], out_id[:, : ids.shape[1]] = kept, ids
    out_p[wide], out_id[wide] = p_all[:, :width], id_all[:, :width]
    return out_p, out_id  # padding columns have weight 0: never drawn


def _draw(logits: torch.Tensor, temperature: float, top_p: float, u: torch.Tensor | None) -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
    """Pick one token per row and its log-prob. logits (B, V) float32, u (B,) uniforms (None for greedy) -> tokens
    (B,) long, logprobs (B,) float32."""
    if temperature == 0:
        tokens = logits.argmax(dim=-1)  # (B,) greedy; first index on ties, as generate
        # temperature-1 log-probs (departure 2): target logit minus log-sum-exp, as token_logprobs computes them
        return tokens, logits.gather(1, tokens.unsqueeze(1)).squeeze(1) - logits.logsumexp(dim=-1)
    z = logits if temperature == 1.0 else logits / temperature  # (B, V) division, as token_logprobs rounds it
    top = z.amax(dim=-1, keepdim=True)  # (B, 1)
    weights = (z - top).exp_()  # (B, V) unnormalised probabilities, the largest 1
    if top_p < 1.0:
        total = weights.sum(dim=-1, dtype=torch.float64)  # (B,)
        kept, ids = _nucleus(weights, total, top_p)  # (B, K) each
        tokens = ids.gather(1, _inverse_cdf(kept, u)[0].unsqueeze(1)).squeeze(1)  # (B,); inversion renormalises
    else:
        tokens, total = _inverse_cdf(weights, u)  # (B,), (B,)
    # full-vocabulary log-prob of the drawn token (departure 2): z - max - log(sum exp(z - max)), the sum in float64
    return tokens, (z.gather(1, tokens.unsqueeze(1)) - top).squeeze(1) - total.log().float()


# ------------------------------------------------------------------------------------------------
# Sampler, part 2: the public entry point and its bookkeeping
# ------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One sampled response.

    tokens: response token ids, including the EOS token when the row stopped at EOS, and the token that completed
        a stop string when it stopped on one (departure 12).
    logprobs: (len(tokens),) float32 on CPU, log-probs of the sampled tokens under softmax(logits / temperature) over
        the full vocabulary (top-p not applied; temperature-1 log-probs for greedy), as ``response_logprobs`` computes.
    ended_with_eos: True when the row stopped at EOS, False otherwise (a stop string, or max_new_tokens).
    stop: the stop string that ended the row, None otherwise.
    """

    tokens: list[int]
    logprobs: torch.Tensor
    ended_with_eos: bool
    stop: str | None = None

    @property
    def finish(self) -> str:
        """How the row ended: "eos", "stop" (a stop string; EOS wins when the same token is both) or "length"."""
        return "eos" if self.ended_with_eos else "stop" if self.stop is not None else "length"


class _StopStrings:
    """Stop-string detection for the rows of one ``sample`` call (departure 12).

    Each row keeps the ids of its last k tokens that carry text (k = the longest string's UTF-8 length + 1); a step
    appends each running row's new token and decodes all the windows in one ``batch_decode``. A row has stopped when
    its window's text contains a string: an occurrence that ended before the new token would have been found at the
    step of the token it ended in, whose window held it whole too."""

    def __init__(self, strings: tuple[str, ...], tokenizer):
        self.strings, self.tokenizer = strings, tokenizer
        self.k = max(len(s.encode("utf-8")) for s in strings) + 1
        self.windows: dict[int, list[int]] = {}  # row -> its last k token ids with text
        self._silent: dict[int, bool] = {}  # token id -> decodes to nothing once special tokens are skipped

    def _decode(self, ids: list[list[int]], skip: bool = True) -> list[str]:
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    def silent(self, token: int) -> bool:
        """A special token the decode skips (it adds no text, so it must not take a place in the window)."""
        if token not in self._silent:
            kept, shown = self._decode([[token]], True)[0], self._decode([[token]], False)[0]
            self._silent[token] = kept == "" and shown != ""
        return self._silent[token]

    def scan(self, rows: list[int], tokens: list[int], skip: list[bool]) -> list[str | None]:
        """Per running row (host lists, one entry each; skip: rows that end anyway, e.g. at EOS), the stop string
        its new token completed, or None. When two complete at once, the one that starts first in the text."""
        hits: list[str | None] = [None] * len(rows)
        at, windows = [], []
        for i, (r, t, s) in enumerate(zip(rows, tokens, skip)):
            if s or self.silent(t):
                continue
            window = self.windows.setdefault(r, [])
            window.append(t)
            if len(window) > self.k:
                del window[0]
            at.append(i)
            windows.append(window)
        if windows:
            for i, text in zip(at, self._decode(windows)):
                found = [(text.find(s), j) for j, s in enumerate(self.strings) if s in text]
                if found:
                    hits[i] = self.strings[min(found)[1]]
        return hits

    def forget(self, row: int) -> None:
        self.windows.pop(row, None)


@dataclass
class _Run:
    """What every decode loop shares: the settings, the queue of prompts not started yet, and the draws so far.

    The draws live on the device: ``draw`` writes each token and its log-prob into (B + 1, max_new_tokens +
    sync_every) buffers at (row, index in its response) and records on the device when a row ends (EOS or the
    cap), so a decode step needs nothing from the host. ``check`` reads which rows have ended, one device-to-host
    copy, every ``sync_every`` steps (departure 16). Row B is a trash row: the static path's free slots draw into
    it (duplicate writes there are never read)."""

    prompts: list[list[int]]
    head: _Head  # lm_head weight (V, H) and the transform of its output
    seeds: torch.Tensor  # (B,) int64, one per prompt (B + 1 after __post_init__: the trash row's seed appended)
    eos: torch.Tensor  # (E,) long
    max_new_tokens: int
    temperature: float
    top_p: float
    capacity: int  # rows in flight at most
    min_refill: int  # free slots that trigger a refill while rows are still running
    keys: list[int] | None = None  # per row, the first row with the same prompt ids (departure 11); None: no sharing
    stops: _StopStrings | None = None  # stop strings (departure 12); None: EOS and the cap only
    sync_every: int = 8  # decode steps between host reads of the ended rows (departure 16)
    bar: object = None
    queue: list[int] | None = None  # prompt indices not started yet, in order (consumed from the front)
    out_len: list[int] | None = None
    ended: list[bool] | None = None
    stopped: list | None = None  # per row, the stop string that ended it (None: EOS or the cap)
    forward_calls: int = 0  # prefill + decode calls of the model body (the benchmark's GPU cost proxy)
    decode_steps: int = 0  # decode calls of the model body
    host_reads: int = 0  # device-to-host reads of the ended rows (``check``), the decode loop's only syncs
    prefill_tokens: int = 0  # prompt tokens (padding excluded) fed to the model body
    pending: dict | None = None  # prompt key -> its rows not taken yet (sharing only)
    stash: object = None  # prefilled prompts whose copies still wait in the queue (sharing only; per decode loop)
    kv_dtype: torch.dtype | None = None  # the dtype K and V are stored in (departure 13); None: as the model makes them
    kv_bytes_per_token: int = 0  # bytes of one token's K and V over all layers, read off the stored tensors
    kv_stored: tuple = ()  # (K dtype, V dtype) of the stored tensors (first layer)
    preemptions: int = 0  # static path: rows sent back to the queue when the pool ran dry (departure 10)
    in_flight: int = 0  # static path: rows in flight summed over decode steps (occupied slots)
    in_flight_peak: int = 0  # static path: most rows in flight at one step
    blocks_peak: int = 0  # static path: most pool blocks in use at once
    blocks_left: int = 0  # static path: blocks still held when the loop ended (0: all returned)
    pool_bytes: int = 0  # static path: bytes of the K/V pool as allocated
    gather_bytes: int = 0  # static path: bytes of one layer's K and V gathered for the attention (transient)
    width_steps: dict | None = None  # static path: width bucket W -> decode steps run at it
    rows_steps: dict | None = None  # static path: slot-count bucket R -> decode steps run at it
    bucket_steps: dict | None = None  # static path: (R, W) -> decode steps run at it
    graphs: int = 0  # static path: CUDA graphs captured (one per bucket used; 0 off CUDA)
    capture_seconds: float = 0.0  # static path: wall time of their warm-ups and captures
    columns_real: int = 0  # static path: the running rows' cached columns summed over decode steps (what the kernel
    # of departure 18 reads; the gathered attention reads R x W a step: bucket_steps)

    def __post_init__(self):
        order = list(range(len(self.prompts)))
        if self.keys is not None:  # copies of a prompt queued together, so one prefill serves them (departure 11)
            order.sort(key=lambda r: (self.keys[r], r))
            self.pending = {}
            for k in self.keys:
                self.pending[k] = self.pending.get(k, 0) + 1
        self.queue = order[::-1]  # reversed: pop() takes the next prompt in order
        n_rows, device = len(self.prompts), self.seeds.device
        self.out_len, self.ended = [0] * n_rows, [False] * n_rows
        self.stopped = [None] * n_rows
        self.trash = n_rows  # the row index free static slots draw into
        self.seeds = torch.cat([self.seeds, self.seeds.new_zeros(1)])  # (B + 1,)
        # a row can draw up to sync_every - 1 tokens past its end before the host sees it ended: room for them
        self.width = self.max_new_tokens + self.sync_every
        self.out_tokens = torch.zeros(n_rows + 1, self.width, dtype=torch.long, device=device)  # (B + 1, W)
        self.out_logp = torch.zeros(n_rows + 1, self.width, dtype=torch.float32, device=device)  # (B + 1, W)
        self.end_len = torch.zeros(n_rows + 1, dtype=torch.long, device=device)  # (B + 1,) 0 while running
        self.end_eos = torch.zeros(n_rows + 1, dtype=torch.bool, device=device)  # (B + 1,) ended at EOS

    @property
    def room(self) -> int:
        """Cache columns a row may write after its prompt: the cap, plus the steps it may run past its end."""
        return self.max_new_tokens + self.sync_every

    def share(self, rows: list[int]) -> list[int]:
        """The prompt keys of the rows just taken (departure 11); each key's count of rows still queued drops."""
        keys = [self.keys[r] for r in rows]
        for k in keys:
            self.pending[k] -= 1
        return keys

    def note_cache(self, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Record the bytes one token's K and V take, from the stored (B, h, W, d) tensors of every layer."""
        self.kv_bytes_per_token = sum(k.element_size() * k.shape[1] * k.shape[3]
                                      + v.element_size() * v.shape[1] * v.shape[3] for k, v in layers)
        self.kv_stored = (layers[0][0].dtype, layers[0][1].dtype) if layers else ()

    def take(self, free: int, alive: int) -> list[int]:
        """Prompts to start now. A refill costs one prefill call whatever its size, so while rows are still
        running it waits until at least min_refill slots are free (or the whole remaining queue fits)."""
        want = min(free, len(self.queue))
        if want == 0 or (alive > 0 and want < min(self.min_refill, len(self.queue))):
            return []
        return [self.queue.pop() for _ in range(want)]

    def draw(self, hidden: torch.Tensor, rows: torch.Tensor, n_out: torch.Tensor) -> torch.Tensor:
        """Draw the next token of each row, entirely on the device (no host read: the static path captures it in
        its CUDA graph). hidden (A, H), rows (A,) original row ids (the trash row for free slots), n_out (A,)
        tokens drawn so far -> tokens (A,). Writes each token and log-prob at (row, n_out) and, for a row that
        ends now (EOS, or its max_new_tokens-th token), its length and whether it was EOS."""
        logits = torch.mm(hidden, self.head.weight.t()).float()  # (A, V), the same expressions token_logprobs uses
        logits = _head_transform_(logits, self.head.logit_scale, self.head.softcap)  # the model's own logits
        u = None if self.temperature == 0 else _uniforms(self.seeds[rows], n_out)  # (A,)
        tokens, logp = _draw(logits, self.temperature, self.top_p, u)  # (A,), (A,)
        col = n_out.clamp(max=self.width - 1)  # (A,) only free slots and rows long past their end get clamped
        self.out_tokens[rows, col] = tokens
        self.out_logp[rows, col] = logp
        is_eos = (tokens.unsqueeze(1) == self.eos).any(dim=1)  # (A,) a compare, not isin: nothing to sync
        ended = self.end_len[rows]  # (A,)
        now = (ended == 0) & (is_eos | (n_out + 1 >= self.max_new_tokens))  # (A,) rows that end with this token
        self.end_len[rows] = torch.where(now, n_out + 1, ended)
        self.end_eos[rows] = self.end_eos[rows] | (now & is_eos)
        return tokens

    def check(self, rows: list[int], rows_t: torch.Tensor, n_out: list[int], since: int) -> list[bool]:
        """Which running rows have ended, read from the device in one transfer (departure 16). rows: host list (A,)
        of original row ids, rows_t the same on the device; n_out: host list (A,) of tokens each row has drawn;
        since: the decode steps since the last read (every row drew that many tokens since). With stop strings the
        same transfer brings those last `since` tokens of every row, scanned on the host in order (departure 12): a
        row whose string completes mid-window ends at that token, its later draws discarded as past an EOS.
        Records the ended rows' lengths and how they ended; returns a host list (A,) of ended flags."""
        self.host_reads += 1
        n_rows = len(rows)
        if self.stops is None:
            end_h, eos_h = torch.stack([self.end_len[rows_t], self.end_eos[rows_t].long()]).tolist()  # one transfer
            hits, at = [None] * n_rows, [0] * n_rows
        else:
            cols = torch.tensor([[min(n - since + j, self.width - 1) for j in range(since)] for n in n_out],
                                dtype=torch.long).to(rows_t.device)  # (A, since) the window's indices, host-built
            window = self.out_tokens[rows_t.unsqueeze(1), cols]  # (A, since)
            data = torch.cat([self.end_len[rows_t].unsqueeze(1), self.end_eos[rows_t].long().unsqueeze(1), window],
                             dim=1).tolist()  # (A, 2 + since): one transfer
            end_h, eos_h = [d[0] for d in data], [d[1] for d in data]
            hits, at = self._scan(rows, n_out, since, end_h, eos_h, [d[2:] for d in data])
        done = [e > 0 or h is not None for e, h in zip(end_h, hits)]
        for r, d, e, x, h, a in zip(rows, done, end_h, eos_h, hits, at):
            if d:
                self.out_len[r], self.ended[r], self.stopped[r] = (a if h is not None else e), bool(x) and h is None, h
                if self.stops is not None:
                    self.stops.forget(r)
        if self.bar is not None:
            self.bar.update(sum(done))
        return done

    def _scan(self, rows: list[int], n_out: list[int], since: int, end_h: list[int], eos_h: list[int],
              window: list[list[int]]) -> tuple[list[str | None], list[int]]:
        """The stop-string scan of a read's window (departure 12): token j of window[i] is row i's token n_out[i] -
        since + j. Tokens are fed to the detector one offset at a time, in order, for the rows still running there
        (none past the row's end on the device; its EOS token skipped, EOS winning). Returns per row the string that
        stopped it (or None) and the length of its response then."""
        hits, at = [None] * len(rows), [0] * len(rows)
        for j in range(since):
            live = [i for i in range(len(rows)) if hits[i] is None
                    and (end_h[i] == 0 or n_out[i] - since + j < end_h[i])]
            if not live:
                break
            found = self.stops.scan([rows[i] for i in live], [window[i][j] for i in live],
                                    [bool(eos_h[i]) and n_out[i] - since + j == end_h[i] - 1 for i in live])
            for i, h in zip(live, found):
                if h is not None:
                    hits[i], at[i] = h, n_out[i] - since + j + 1
        return hits, at

    def rollouts(self) -> list[Rollout]:
        n_rows = len(self.prompts)
        tokens_cpu, logp_cpu = self.out_tokens[:n_rows].cpu(), self.out_logp[:n_rows].cpu()
        out = []
        for i in range(n_rows):
            n = self.out_len[i]
            assert 0 < n <= self.max_new_tokens and (self.ended[i] or self.stopped[i] is not None
                                                     or n == self.max_new_tokens), f"row {i}: {n} tokens"
            out.append(Rollout(tokens_cpu[i, :n].tolist(), logp_cpu[i, :n].clone(), self.ended[i], self.stopped[i]))
        return out


def resolve_static(static, model, device: torch.device, windows: list[int | None] | None = None) -> bool | str:
    """sample()'s ``static`` resolved for this model and device (departure 10): True for the static path, False
    for the default one, "auto" when auto chose the static path (it may still fall back if the cache budget
    holds no row at full length). "on" / True on a model the static path cannot run raises a ValueError naming
    the config field.

    The static path (and so its CUDA graph) needs every layer to be full attention, with sdpa or eager attention:
    its per-slot mask is one (S, 1, 1, L) mask for every layer. Sliding-window layers (Mistral, Gemma-2/3,
    Cohere-2, Qwen's max_window_layers) would need a second, windowed mask per layer type and a prefill whose cache
    is not trimmed to the window; hybrid models with recurrent or chunked-attention layers keep state that is not a
    slot of K/V; flash-attention and flex kernels take their masks in other forms. These run the default path, and
    "auto" picks it for them, as on CPU, where there is no graph to capture and the static path's gathered attention
    over W columns per slot costs more than the default path's (bench/sampler.py --only tiny-eval)."""
    windows = _layer_windows(model.config) if windows is None else windows
    if static is True or static == "on":
        if windows is None or any(w is not None for w in windows):
            raise ValueError(f"sampler.py sample(): static=True needs full attention in every layer; "
                             f"{type(model).__name__} has sliding-window or other layers (config.sliding_window="
                             f"{getattr(model.config, 'sliding_window', None)}, config.layer_types="
                             f"{getattr(model.config, 'layer_types', None)}); the default path (static='off') "
                             f"supports sliding windows")
        if model.config._attn_implementation not in ("sdpa", "eager"):
            raise ValueError(f"sampler.py sample(): static=True supports sdpa and eager attention, not "
                             f"{model.config._attn_implementation!r}")
        return True
    if static is False or static == "off":
        return False
    if static != "auto":
        raise ValueError(f"sampler.py sample(): static must be 'auto', 'on', 'off', True or False, got {static!r}")
    capturable = (windows is not None and all(w is None for w in windows)
                  and model.config._attn_implementation in ("sdpa", "eager"))
    return "auto" if torch.device(device).type == "cuda" and capturable else False


# With static="auto" and no max_cache_bytes, the static path's K/V (its pool and a step's transient gather) may take
# this share of the device's free memory at the call (the rest for the prefill's activations and the logits): a
# caller with no plan of its own. The trainer passes runtime.kv_budget's (a share of what its state leaves, 0.75).
_AUTO_CACHE_SHARE = 0.8


@contextlib.contextmanager
def cast_weights_once(model, device: torch.device, *, enabled: bool = True):
    """Departure 17: while autocast is on for the device, every nn.Linear whose weight is float32 serves a copy of
    it in autocast's dtype for the block (cast once here), then gets its own weight back. Yields the bytes cast.

    Why: the decode loop runs under ``torch.inference_mode``, where autocast keeps no cache of weight casts, so
    without this every decode step re-casts every float32 weight (one cast per matmul: ~200 kernels and ~10 GB of
    traffic per step for Qwen3-1.7B; ``bench/decode.py`` counts them). Autocast's cast of a float32 tensor is the
    same rounding as ``.to()``, and autocast leaves a tensor already in its dtype alone, so every matmul sees the
    same operands as before: the same tokens and log-probs (tested). Only nn.Linear weights are swapped (those are
    what autocast casts; norms and embeddings stay float32 as autocast leaves them), per module, so a tied
    embedding keeps its float32 table while the lm_head reads the copy. Weights used through other ops (MoE experts
    held as bare Parameters) are still cast per step by autocast. Memory: one copy of the Linear weights in 2 bytes
    per parameter for the call (plan.py counts it). Under FSDP2 inside runtime.gathered the layers hold their full
    weights as plain tensors, which are cast like any other (tests/test_gpu_path.py); sharded DTensor parameters
    (outside a gather) are left alone."""
    if not enabled or not torch.is_autocast_enabled(device.type):
        yield 0
        return
    dtype = torch.get_autocast_dtype(device.type)
    casts: dict[int, torch.Tensor] = {}
    swapped = []
    for module in model.modules():
        weight = module._parameters.get("weight") if isinstance(module, torch.nn.Linear) else None
        if weight is None or weight.dtype != torch.float32 or type(weight.data).__name__ == "DTensor":
            continue
        if id(weight) not in casts:
            casts[id(weight)] = weight.detach().to(dtype)
        swapped.append((module, weight))
        module._parameters["weight"] = casts[id(weight)]  # not a Parameter: the block runs without grad
    try:
        yield sum(c.numel() * c.element_size() for c in casts.values())
    finally:
        for module, weight in swapped:
            module._parameters["weight"] = weight


def _stop_strings(stop_strings, tokenizer) -> _StopStrings | None:
    """sample()'s stop_strings argument checked: None when there are none, else the detector (departure 12)."""
    strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings or ())
    if not strings:
        return None
    bad = [s for s in strings if not isinstance(s, str) or s == ""]
    if bad:
        raise ValueError(f"sampler.py sample(): stop_strings must be non-empty strings, got {bad!r}")
    if tokenizer is None or not hasattr(tokenizer, "batch_decode"):
        raise ValueError("sampler.py sample(): stop_strings need the model's tokenizer (tokenizer=, with "
                         "batch_decode) to decode the responses")
    return _StopStrings(tuple(dict.fromkeys(strings)), tokenizer)


def sample(
    model,
    prompts,
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    eos_token_id,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    max_batch_size: int | None = None,
    min_refill: int | None = None,
    static: bool | str = "auto",
    share_prefix: bool = True,
    stop_strings: str | list[str] | None = None,
    tokenizer=None,
    progress: bool = False,
    stats: dict | None = None,
    max_cache_bytes: int | None = None,
    sync_every: int = 8,
    cast_once: bool = True,
    block_size: int = 16,
    attention: str = "auto",
) -> list[Rollout]:
    """Sample one response per prompt from a transformers causal LM, with continuous batching.

    Args:
        model: a transformers causal LM with a plain lm_head (departure 1); its device and dtype are used as they are.
        prompts: B token-id lists (or 1-D LongTensors) of any lengths >= 1.
        max_new_tokens: cap on response length (EOS included).
        temperature: 0 for greedy, else logits are divided by it before sampling.
        top_p: nucleus mass in (0, 1]; 1 samples from the full distribution. Ignored for greedy.
        eos_token_id: an int or a list of ints; a row stops after producing any of them (ids outside [0, V) are
            never produced: every row then runs to max_new_tokens).
        pad_token_id: id written into padding slots (masked out, so any id in [0, V) will do; default 0).
        generator: torch.Generator (any device) from which one seed per prompt is drawn, in prompt order
            (departure 7); None uses torch's default generator.
        max_batch_size: rows in flight at most (bounds the default path's KV cache; the static path's slot count
            S, with max_cache_bytes deciding below it); None = all prompts at once. When rows finish, waiting
            prompts take their places (departure 6).
        min_refill: while rows are running, waiting prompts are prefilled only once this many slots are free (or the
            whole queue fits), so that one prefill call serves several; default max(1, max_batch_size // 8).
        static: "auto" (default), "on" / True or "off" / False: the static-shape decode path (departure 10), a
            paged KV pool and a fixed-shape decode step captured as CUDA graphs on CUDA. "auto" takes it on CUDA
            for models it supports (every layer full attention, sdpa or eager attention) when max_cache_bytes holds
            one row at full length, the default path elsewhere (``resolve_static``). Same results as the default
            path up to float round-off.
        share_prefix: rows with the same prompt ids share one prefill (departure 11); same results as False up to
            float round-off. Only for models whose layers all use full or sliding-window attention.
        stop_strings: a string or a list of them (departure 12): a row ends at the first token after which its
            decoded response contains one (that token kept; ``Rollout.stop`` names the string). None or [] for none.
        tokenizer: the model's transformers tokenizer (``batch_decode``); needed with stop_strings.
        progress: show a tqdm bar over finished rows.
        stats: if a dict is given, ``stats["forward_calls"]`` receives the number of model-body calls (prefills and
            decode steps): a GPU decode step costs about the same whatever the rows alive, so this counts the cost;
            ``stats["prefill_tokens"]`` the prompt tokens fed to it (padding excluded); ``stats["kv_dtypes"]`` the (K,
            V) dtypes of the cache (its first layer) and ``stats["kv_bytes_per_token"]`` the bytes one token's K and V
            take over all layers, both read off the stored tensors (departure 13); ``stats["static"]`` whether the
            static path ran; when it did (departures 10, 13): ``stats["slots"]`` the slot count S, ``"kv_block_size"``
            and ``"kv_blocks"`` the pool's block size and usable blocks, ``"kv_pool_bytes"`` the pool's bytes as
            allocated (trash block included), ``"kv_gather_bytes"`` one layer's gathered K and V at S x L with
            transformers' copies of it (transient, departure 13; 0 with the kernel), ``"attention"`` "kernel" or
            "gather" and ``"attention_why"`` why (departure 18), ``"kv_columns_real"`` the running rows' cached
            columns summed over the decode steps (what the kernel's attention reads; the gathered one reads R x W
            per step, ``"bucket_steps"``), ``"graphs"`` and ``"capture_seconds"`` the CUDA graphs captured and the
            wall time of their warm-ups and captures (0 off CUDA), ``"kv_blocks_peak"`` the most blocks in use at once,
            ``"kv_blocks_held_at_end"`` the blocks not returned (0), ``"rows_in_flight_mean"`` and
            ``"rows_in_flight_peak"`` the occupied slots per decode step, ``"preemptions"`` the rows sent back when the
            pool ran dry, ``"width_steps"``, ``"rows_steps"`` and ``"bucket_steps"`` width bucket W, slot-count bucket R
            and (R, W) -> decode steps run at it; ``stats["decode_steps"]`` and ``stats["host_reads"]`` the decode calls
            and the device-to-host reads of ended rows (departure 16); ``stats["cast_bytes"]`` the bytes of the weights
            cast once (departure 17).
        max_cache_bytes: with the static path, the bytes its K/V may take: the paged pool plus one layer's gathered K/V
            and transformers' copies of it (departure 13 has the arithmetic); rows in flight are what the pool holds by
            their real lengths, at most S. None: max_batch_size slots, each with blocks for a full-length row, with
            "on"; with "auto", 80% of the device's free memory. The default path ignores it.
        sync_every: decode steps between the host's reads of which rows have ended (departure 16); 1 reads every
            step. Stop strings are checked at the same reads.
        cast_once: under autocast with float32 weights, cast every nn.Linear weight to autocast's dtype once for the
            call instead of autocast re-casting it on every decode step (departure 17); the same numbers.
        block_size: tokens per block of the static path's KV pool (departure 10): the granularity of its
            allocation. The default path ignores it.
        attention: the static path's decode attention (departure 18): "kernel" reads each row's blocks in place
            (Triton, on CUDA), "gather" copies every slot's first W columns out of the pool for the model's own
            attention, "auto" (default) the kernel where ``resolve_attention`` finds it can run, else gather. The
            default path ignores it.

    Returns:
        B Rollouts, in prompt order.
    """
    assert max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {max_new_tokens}"
    assert temperature >= 0, f"temperature must be >= 0, got {temperature}"
    assert 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}"
    eos_ids = [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]
    assert eos_ids, "eos_token_id must name at least one token"
    pad_token_id = 0 if pad_token_id is None else int(pad_token_id)  # pads are masked out: any valid id does
    prompts = [_as_id_list(p) for p in prompts]
    assert all(len(p) > 0 for p in prompts), "every prompt needs at least one token"
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"sampler.py sample(): max_batch_size must be >= 1 or None, got {max_batch_size}")
    stops = _stop_strings(stop_strings, tokenizer)
    head = _head(model)
    device = head.weight.device
    _check_ids(prompts, head.weight.shape[0], "prompts")
    n_rows = len(prompts)
    if n_rows == 0:
        return []
    capacity = n_rows if max_batch_size is None else min(max_batch_size, n_rows)
    windows = _layer_windows(model.config)  # per layer: None (full attention) or its sliding window
    if capacity < n_rows and windows is None:
        raise ValueError(f"sampler.py sample(): max_batch_size < len(prompts) needs every layer to use full or "
                         f"sliding-window attention; {type(model).__name__} has other KV-cache layers "
                         f"(config.layer_types={getattr(model.config, 'layer_types', None)})")
    kv_dtype = _kv_dtype(device)  # departure 13: under autocast, K and V are cached in autocast's dtype
    static = resolve_static(static, model, device, windows)
    if static == "auto" and max_cache_bytes is None:
        # "auto" must never preallocate past the card for a caller that gave no budget: the free memory's share
        max_cache_bytes = int(_AUTO_CACHE_SHARE * torch.cuda.mem_get_info(device)[0])
    if sync_every < 1:
        raise ValueError(f"sampler.py sample(): sync_every must be >= 1, got {sync_every}")
    if block_size < 1:
        raise ValueError(f"sampler.py sample(): block_size must be >= 1, got {block_size}")
    plan = None
    if static:  # departure 13: the paged pool's slots and blocks from the byte budget
        length = max(len(p) for p in prompts) + max_new_tokens
        token_bytes = _kv_token_bytes(model, kv_dtype)
        layers = model.config.get_text_config(decoder=True).num_hidden_layers
        path, path_why = resolve_attention(attention, model, device, dtype=kv_dtype, block_size=block_size)
        copies = 0 if path == "kernel" else transient_copies(model.config)  # the kernel gathers nothing
        expected = -(-sum(map(len, prompts)) // n_rows) + -(-max_new_tokens // 2) + sync_every
        plan = pool_plan(slots=capacity, length=length, expected=expected,
                          block_size=block_size, token_bytes=token_bytes, layers=layers, budget=max_cache_bytes,
                          copies=copies)
        if plan is None and static == "auto":
            static = False  # "auto" only takes the static path where it fits; the default path's cache grows
        elif plan is None:
            row = (-(-length // block_size) + 1) * block_size * token_bytes
            raise ValueError(f"sampler.py sample(): max_cache_bytes={max_cache_bytes} holds no slot of the static path "
                             f"(one row of {length} columns in {block_size}-token blocks, with the trash block, takes "
                             f"{row} bytes, and one layer's gathered K/V and its copies "
                             f"{copies * (length * token_bytes // layers)} bytes); "
                             f"raise it, lower max_new_tokens, or use static='off'")
        else:
            capacity = plan.slots
    static = bool(static)
    run = _Run(
        prompts, head, _row_seeds(n_rows, generator, device),
        torch.tensor(eos_ids, dtype=torch.long, device=device), max_new_tokens, float(temperature), float(top_p),
        capacity, max(1, capacity // 8) if min_refill is None else max(1, int(min_refill)),
        keys=_prompt_keys(prompts) if share_prefix and windows is not None else None, stops=stops,
        sync_every=int(sync_every), kv_dtype=kv_dtype,
    )
    base = _base_model(model)
    was_training = model.training
    model.eval()  # departure 5: no dropout while sampling
    run.bar = tqdm(total=n_rows, desc="sampling", unit="row") if progress else None
    # inference_mode rather than no_grad: it also skips view and version-counter bookkeeping, a visible share of a
    # small model's decode step. Its tensors never escape: the rollouts' tensors are copied out after it.
    cast_bytes = 0
    try:
        with torch.inference_mode(), cast_weights_once(model, device, enabled=cast_once) as cast:
            run.head, cast_bytes = _head(model), cast  # the lm_head weight as cast (departure 17)
            if static:
                _decode_static(model, base, run, pad_token_id, plan, kernel=path == "kernel")
            else:
                _decode_dynamic(model, base, run, pad_token_id, windows)
    finally:
        if run.bar is not None:
            run.bar.close()
        model.train(was_training)
    if stats is not None:
        stats["forward_calls"], stats["prefill_tokens"] = run.forward_calls, run.prefill_tokens
        stats["kv_dtypes"], stats["kv_bytes_per_token"] = run.kv_stored, run.kv_bytes_per_token
        stats["static"], stats["decode_steps"], stats["host_reads"] = static, run.decode_steps, run.host_reads
        stats["cast_bytes"] = cast_bytes
        if static:
            stats["slots"], stats["kv_block_size"], stats["kv_blocks"] = capacity, plan.block_size, plan.blocks
            stats["kv_pool_bytes"], stats["kv_gather_bytes"] = run.pool_bytes, run.gather_bytes
            stats["kv_blocks_peak"], stats["kv_blocks_held_at_end"] = run.blocks_peak, run.blocks_left
            stats["rows_in_flight_mean"] = run.in_flight / max(1, run.decode_steps)
            stats["rows_in_flight_peak"], stats["preemptions"] = run.in_flight_peak, run.preemptions
            stats["width_steps"], stats["rows_steps"] = run.width_steps, run.rows_steps
            stats["bucket_steps"] = run.bucket_steps
            stats["attention"], stats["attention_why"] = path, path_why
            stats["kv_columns_real"] = run.columns_real
            stats["graphs"], stats["capture_seconds"] = run.graphs, run.capture_seconds
    return run.rollouts()


# ------------------------------------------------------------------------------------------------
# Sampler, part 3: the default path. Left-padded rows in a DynamicCache; finished rows leave it, refills are
# prefilled together and merged in by left-padding the shorter of the two caches
# ------------------------------------------------------------------------------------------------


@dataclass
class _Batch:
    """Rows in flight. Every row's next token sits in the last column (left padding), so one decode step feeds
    (B, 1) tokens. attn (B, width + room) bool: columns < width describe the cache, later ones are True already
    (a row still present has a real token in every column written after its prompt), so a step passes a view.
    The host keeps what the schedule needs (row ids, start steps, padding), so no step waits for the device for it."""

    cache: DynamicCache
    attn: torch.Tensor  # (B, width + room) bool
    width: int  # cache columns
    next_pos: torch.Tensor  # (B, 1) position of each row's next token
    rows: torch.Tensor  # (B,) original prompt index
    n_out: torch.Tensor  # (B,) tokens drawn so far
    hidden: torch.Tensor  # (B, H) final hidden state that predicts each row's next token
    rows_host: list[int]  # the same prompt indices on the host
    starts: list[int]  # step of the loop at which each row drew its first token: n_out = step - start
    pads: list[int]  # leading padding columns of each row in the cache


class _StoredCache(DynamicCache):
    """A DynamicCache that stores K and V in ``kv_dtype`` (departure 13; None: as they come). The attention reads
    them back from the cache, so it sees the stored dtype too, which is what autocast's attention casts to anyway."""

    def __init__(self, *args, kv_dtype: torch.dtype | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.kv_dtype = kv_dtype

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.kv_dtype is not None:
            key_states, value_states = key_states.to(self.kv_dtype), value_states.to(self.kv_dtype)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


def _prefill(model, base, run: _Run, rows: list[int], pad_token_id: int, step: int) -> _Batch:
    """One forward over the left-padded prompts of `rows` into a fresh DynamicCache; they draw first at `step`."""
    device = run.head.weight.device
    lens = torch.tensor([len(run.prompts[r]) for r in rows], dtype=torch.long)  # (b,)
    width = int(lens.max())
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)  # (b, P)
    for i, r in enumerate(rows):
        ids[i, width - lens[i] :] = torch.tensor(run.prompts[r], dtype=torch.long)
    attn = torch.ones(len(rows), width + run.room, dtype=torch.bool)  # (b, P + room)
    attn[:, :width] = torch.arange(width).unsqueeze(0) >= (width - lens).unsqueeze(1)
    # position of prompt column j in row i is j - (number of pads); pads get 0 (they are masked out anyway)
    positions = (torch.arange(width).unsqueeze(0) - (width - lens).unsqueeze(1)).clamp(min=0)  # (b, P)
    cache = _StoredCache(config=model.config, kv_dtype=run.kv_dtype)
    hidden = base(
        input_ids=ids.to(device), attention_mask=attn[:, :width].to(device), position_ids=positions.to(device),
        use_cache=True, **{_cache_kwarg(base): cache},
    ).last_hidden_state[:, -1]  # (b, H): left padding puts every row's last prompt token in the last column
    run.forward_calls += 1
    run.note_cache([(layer.keys, layer.values) for layer in cache.layers])
    run.prefill_tokens += int(lens.sum())
    rows_t = torch.tensor(rows, dtype=torch.long, device=device)  # (b,)
    return _Batch(cache, attn.to(device), width, lens.to(device).unsqueeze(1), rows_t, torch.zeros_like(rows_t),
                  hidden, list(rows), [step] * len(rows), (width - lens).tolist())


def _left_pad(x: torch.Tensor, width: int, dim: int, value) -> torch.Tensor:
    """x padded on the left along `dim` to `width` with `value`."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_full(shape, value), x], dim=dim)


def _cache_columns(width: int, window: int | None) -> int:
    """Columns a cache layer holds for a batch `width` columns wide: all of them, or the last W - 1 of a sliding
    window of W (what transformers' DynamicSlidingWindowLayer keeps between forwards)."""
    return width if window is None else min(width, window - 1)


def _set_width(layer, width: int, window: int | None) -> None:
    """A sliding layer derives its mask's offset from the columns it has seen (``cumulative_length``), not from the
    columns it holds: after a merge or a trim it must count the batch's new width, as the full layers do."""
    if window is not None:
        layer.cumulative_length = width


def _merge(a: _Batch, b: _Batch, room: int, windows: list[int | None]) -> _Batch:
    """Batch a's rows then b's, both caches left-padded to the wider one (the padding columns are masked out and
    positions are per row, so every row computes what it computed before). A sliding layer holds the last
    min(width, W - 1) columns of each batch: each is left-padded to that many columns of the merged width."""
    width = max(a.width, b.width)
    for la, lb, window in zip(a.cache.layers, b.cache.layers, windows):
        cols = _cache_columns(width, window)
        la.keys = torch.cat([_left_pad(la.keys, cols, 2, 0.0), _left_pad(lb.keys, cols, 2, 0.0)])  # (B, h, W, d)
        la.values = torch.cat([_left_pad(la.values, cols, 2, 0.0), _left_pad(lb.values, cols, 2, 0.0)])
        _set_width(la, width, window)
    attn = torch.ones(a.attn.shape[0] + b.attn.shape[0], width + room, dtype=torch.bool, device=a.attn.device)
    attn[:, :width] = torch.cat([_left_pad(a.attn[:, : a.width], width, 1, False),
                                 _left_pad(b.attn[:, : b.width], width, 1, False)])  # (B, W)
    cat = lambda x, y: torch.cat([x, y])
    pads = [p + width - a.width for p in a.pads] + [p + width - b.width for p in b.pads]
    return _Batch(a.cache, attn, width, cat(a.next_pos, b.next_pos), cat(a.rows, b.rows), cat(a.n_out, b.n_out),
                  cat(a.hidden, b.hidden), a.rows_host + b.rows_host, a.starts + b.starts, pads)


def _keep(batch: _Batch, keep: list[int], windows: list[int | None] | None) -> _Batch:
    """Only the rows `keep` stay: cache rows, mask rows, row state. Leading columns that became padding in every
    remaining row are cut (a view, no copy), so the cache stays as wide as its longest row, not as the run; a sliding
    layer keeps the last min(new width, W - 1) of its columns. Nothing is cut when some layer keeps another kind of
    cache (windows None)."""
    keep_t = torch.tensor(keep, dtype=torch.long, device=batch.rows.device)  # (B',)
    batch.cache.batch_select_indices(keep_t)
    pads = [batch.pads[i] for i in keep]
    lead = min(pads) if windows is not None else 0  # columns that are padding in every remaining row
    attn = batch.attn[keep_t, lead:]
    width = batch.width - lead
    if lead > 0:
        for layer, window in zip(batch.cache.layers, windows):
            cols = _cache_columns(width, window)
            layer.keys, layer.values = layer.keys[:, :, -cols:], layer.values[:, :, -cols:]  # cols >= 1: a prompt
            _set_width(layer, width, window)
    return _Batch(batch.cache, attn, width, batch.next_pos[keep_t], batch.rows[keep_t],
                  batch.n_out[keep_t], batch.hidden[keep_t], [batch.rows_host[i] for i in keep],
                  [batch.starts[i] for i in keep], [p - lead for p in pads])


def _select(batch: _Batch, index: list[int], windows: list[int | None] | None) -> _Batch:
    """Rows `index` of batch (repeats allowed) in a cache of their own, trimmed as ``_keep`` trims; batch itself is
    left as it is (``batch_select_indices`` gives the shallow copy's layers new tensors, the original keeps its)."""
    cache = copy.copy(batch.cache)
    cache.layers = [copy.copy(layer) for layer in batch.cache.layers]
    return _keep(dataclasses.replace(batch, cache=cache), index, windows)


def _prefill_shared(model, base, run: _Run, rows: list[int], pad_token_id: int, step: int,
                    windows: list[int | None] | None) -> _Batch:
    """``_prefill`` with one prefill per distinct prompt (departure 11). The distinct prompts not in ``run.stash``
    (a _Batch with one row per prompt key whose copies were partly taken before) go through one forward; each row
    then gets its own copy of its prompt's cache rows and of the hidden state that draws its first token. Prompts
    with copies still queued stay in the stash (one row each), the others leave it."""
    keys = run.share(rows)
    stash = run.stash
    held = set() if stash is None else set(stash.rows_host)
    new = [k for k in dict.fromkeys(keys) if k not in held]
    src = stash
    if new:
        fresh = _prefill(model, base, run, new, pad_token_id, step)  # rows_host = keys: a key is one of its rows
        src = fresh if stash is None else _merge(stash, fresh, run.room, windows)
    at = {k: i for i, k in enumerate(src.rows_host)}
    waiting = [i for i, k in enumerate(src.rows_host) if run.pending[k] > 0]
    run.stash = _select(src, waiting, windows) if waiting else None
    batch = _select(src, [at[k] for k in keys], windows)  # (b rows)
    batch.rows = torch.tensor(rows, dtype=torch.long, device=batch.rows.device)  # (b,)
    batch.n_out = torch.zeros_like(batch.rows)  # (b,)
    batch.rows_host, batch.starts = list(rows), [step] * len(rows)
    return batch


def _decode_dynamic(model, base, run: _Run, pad_token_id: int, windows: list[int | None] | None) -> None:
    """The default decode loop: draw, drop finished rows, one decode step for the rest, refill. windows: each
    layer's sliding window (None: full attention), or None for a model with other cache layers (never refilled)."""
    cache_arg = _cache_kwarg(base)
    # For SDPA models without sliding-window layers, a decode step's mask is just the padding mask, and transformers
    # passes a ready 4D mask through untouched: hand it a (B, 1, 1, cur) view of the buffer and skip the per-step
    # mask construction (about a tenth of a tiny model's step). Other attention kernels get the 2D mask.
    ready_4d = model.config._attn_implementation == "sdpa" and windows is not None and all(w is None for w in windows)
    step = 0

    def prefill(rows: list[int]) -> _Batch:
        if run.keys is None:
            return _prefill(model, base, run, rows, pad_token_id, step)
        return _prefill_shared(model, base, run, rows, pad_token_id, step, windows)

    batch = prefill(run.take(run.capacity, 0))
    since = 0  # decode steps since the last host read
    while batch is not None:
        tokens = run.draw(batch.hidden, batch.rows, batch.n_out)  # (B,)
        step += 1
        since += 1
        # departure 16: the host learns which rows ended every sync_every steps (every step with stop strings), or
        # as soon as every row has drawn max_new_tokens (known on the host: nothing left to run)
        if since >= run.sync_every or step - max(batch.starts) >= run.max_new_tokens:
            flags = run.check(batch.rows_host, batch.rows, [step - s for s in batch.starts], since)
            since = 0
            keep = [i for i, d in enumerate(flags) if not d]
            if len(keep) < len(flags):
                batch, tokens = (_keep(batch, keep, windows), tokens[keep]) if keep else (None, None)
        if batch is not None:
            cur = batch.width + 1  # cache columns once this step's token is in
            mask = batch.attn[:, None, None, :cur] if ready_4d else batch.attn[:, :cur]  # (B, 1, 1, cur) / (B, cur)
            batch.hidden = base(
                input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=batch.next_pos, use_cache=True,
                **{cache_arg: batch.cache},
            ).last_hidden_state[:, -1]  # (B, H)
            run.forward_calls += 1
            run.decode_steps += 1
            batch.width, batch.next_pos, batch.n_out = cur, batch.next_pos + 1, batch.n_out + 1
        alive = 0 if batch is None else len(batch.rows_host)
        new = run.take(run.capacity - alive, alive)  # slots free up only at a check: between them this takes none
        if new:
            fresh = prefill(new)
            batch = fresh if batch is None else _merge(batch, fresh, run.room, windows)


# ------------------------------------------------------------------------------------------------
# Sampler, part 4a: decode attention that reads the paged pool in place (departure 18). One Triton program per
# (slot, KV head) walks the slot's blocks through the block table up to the slot's own length, with an online
# softmax over tiles of columns for all the query heads that share the KV head: each real column of K and V is read
# once, nothing is gathered and nothing is copied to every query head.
# ------------------------------------------------------------------------------------------------


def paged_attention_reference(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                              lengths: torch.Tensor, *, scale: float, block_size: int) -> torch.Tensor:
    """What ``paged_attention`` computes, in plain PyTorch (gather every slot's columns, then a masked softmax in
    float32, or float64 for float64 inputs): the reference the kernel is tested against and its CPU stand-in.

    query (R, H, d): one token per slot; k_pool, v_pool (N, h, d), N a multiple of block_size, H a multiple of h
    (query head i reads KV head i // (H / h), as transformers' repeat_kv pairs them); table (R, nb) long: the pool
    block of each slot's j-th block of columns; lengths (R,) long >= 1: the columns each slot attends over (its
    cached tokens, the current one included). Returns (R, H, d) in query's dtype."""
    rows, heads, dim = query.shape  # (R, H, d)
    group = heads // k_pool.shape[1]
    width = int(table.shape[1]) * block_size
    cols = torch.arange(width, device=query.device)  # (W,)
    index = table.index_select(1, cols // block_size) * block_size + cols % block_size  # (R, W) pool rows
    work = torch.promote_types(query.dtype, torch.float32)  # float32 (float64 stays float64: the tests' check)
    keys = k_pool[index].to(work).repeat_interleave(group, dim=2)  # (R, W, H, d)
    values = v_pool[index].to(work).repeat_interleave(group, dim=2)  # (R, W, H, d)
    scores = torch.einsum("rhd,rwhd->rhw", query.to(work), keys) * scale  # (R, H, W)
    scores = scores.masked_fill(cols[None, None, :] >= lengths[:, None, None], float("-inf"))
    return torch.einsum("rhw,rwhd->rhd", scores.softmax(-1), values).to(query.dtype)  # (R, H, d)


if triton is not None:  # defined at import: Triton reads TRITON_INTERPRET (CPU tests) when it decorates
    @triton.jit
    def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, len_ptr, out_ptr, scale,
                             stride_qr, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh, stride_tr,
                             stride_or, stride_oh, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr,
                             DIM_PAD: tl.constexpr, BLOCK: tl.constexpr, TILE: tl.constexpr,
                             PRECISION: tl.constexpr):
        """One (slot, KV head): out[slot, heads of kv_head] = softmax(q K^T * scale) V over the slot's first n
        columns, K and V read through the block table, an online softmax over tiles of TILE columns."""
        slot = tl.program_id(0)
        kv_head = tl.program_id(1)
        n = tl.load(len_ptr + slot)  # the slot's columns: a device value, so a captured graph serves any length
        g = tl.arange(0, GROUP_PAD)  # the query heads of this KV head, padded to a tl.dot's 16 rows
        d = tl.arange(0, DIM_PAD)
        t = tl.arange(0, TILE)
        g_ok, d_ok = g < GROUP, d < DIM
        q = tl.load(q_ptr + slot * stride_qr + (kv_head * GROUP + g)[:, None] * stride_qh + d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # (G, D)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max of the scores
        s_sum = tl.zeros([GROUP_PAD], tl.float32)  # running sum of exp(score - m)
        acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)  # running sum of exp(score - m) x value
        for start in range(0, n, TILE):
            col = start + t  # (T,) columns of this tile
            col_ok = col < n
            block = tl.load(table_ptr + slot * stride_tr + col // BLOCK, mask=col_ok, other=0)  # (T,)
            row = block * BLOCK + col % BLOCK  # (T,) pool rows
            k = tl.load(k_ptr + row[:, None] * stride_kn + kv_head * stride_kh + d[None, :],
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # (T, D)
            v = tl.load(v_ptr + row[:, None] * stride_vn + kv_head * stride_vh + d[None, :],
                        mask=col_ok[:, None] & d_ok[None, :], other=0.0)  # (T, D)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (G, T), float32
            s = tl.where(col_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds a real column (start < n)
            p = tl.exp(s - m_new[:, None])  # (G, T)
            alpha = tl.exp(m - m_new)  # rescales what the earlier tiles summed
            s_sum = s_sum * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)  # (G, D)
            m = m_new
        out = acc / s_sum[:, None]
        tl.store(out_ptr + slot * stride_or + (kv_head * GROUP + g)[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])


def paged_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                    lengths: torch.Tensor, *, scale: float, block_size: int, tile: int = 64) -> torch.Tensor:
    """Decode attention of one query token per slot over the slot's own columns of a paged K/V pool, read in place
    (departure 18): the Triton kernel, on CUDA (or on CPU under TRITON_INTERPRET=1). Same arguments and result as
    ``paged_attention_reference``: query (R, H, d), k_pool and v_pool (N, h, d), table (R, nb), lengths (R,) >= 1;
    returns (R, H, d) in query's dtype. ``tile`` columns are scored per iteration (a power of two >= 16).

    Scores and the softmax are float32; the two products take the pool's dtype (bf16 on the GPU path: tensor
    cores, float32 accumulation, as sdpa's kernels; float32 pools multiply in full float32, not TF32). No launch
    reads the host: one program per (slot, KV head), the loop bound read from ``lengths`` on the device."""
    rows, heads, dim = query.shape  # (R, H, d)
    kv_heads = k_pool.shape[1]
    group = heads // kv_heads
    assert group * kv_heads == heads, f"query heads {heads} are not a multiple of the pool's KV heads {kv_heads}"
    assert k_pool.shape == v_pool.shape and k_pool.shape[2] == dim, (k_pool.shape, v_pool.shape, dim)
    assert k_pool.stride(2) == 1 and v_pool.stride(2) == 1 and table.stride(1) == 1, "inner dimensions contiguous"
    dtype = query.dtype
    query = query.to(k_pool.dtype).contiguous()  # the products run in the pool's dtype
    out = torch.empty(rows, heads, dim, dtype=k_pool.dtype, device=query.device)  # (R, H, d)
    pad = lambda x: max(16, 1 << (x - 1).bit_length())  # tl.arange needs powers of two, tl.dot 16 at least
    precision = "ieee" if k_pool.dtype == torch.float32 else "tf32"  # tf32 is ignored for 2-byte inputs
    _paged_decode_kernel[(rows, kv_heads)](
        query, k_pool, v_pool, table, lengths, out, float(scale),
        query.stride(0), query.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        table.stride(0), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=pad(group), DIM=dim, DIM_PAD=pad(dim), BLOCK=block_size, TILE=tile,
        PRECISION=precision,
    )
    return out.to(dtype)

# The model families whose attention modules the kernel was checked to compute exactly as transformers' own
# (tests/test_sampler.py, the architecture sweep under Triton's interpreter): their models hand their forward's
# kwargs down to the attention function, and their modules give it one query token, the cache's K/V and a
# `scaling`, and nothing else that changes the result (no logit soft-cap, no sinks). Left out: StableLM (its layers
# drop the kwargs), GPT-2 (its scaling depends on config fields the function is not given). A family not listed
# takes the gathered attention: fail closed.
_KERNEL_MODEL_TYPES = frozenset({"llama", "qwen2", "qwen3", "qwen3_moe", "smollm3", "mistral", "phi3", "olmo", "olmo2",
                                 "gemma", "nanochat", "granite", "cohere", "gpt_neox"})

# The name the kernel is registered under in transformers' AttentionInterface; a static step sets the model's
# config._attn_implementation to it for the length of its forward (departure 18).
_KERNEL_ATTENTION = "graft_paged"


def paged_kernel_blocker(config) -> str | None:
    """Why the paged decode kernel cannot serve this model (departure 18), or None when it can: the model family
    must be one the kernel was checked on (``_KERNEL_MODEL_TYPES``) with sdpa or eager attention (the static
    path's), its query heads a multiple of its KV heads. Says nothing of the machine: ``sample`` also needs Triton
    and a CUDA device (or the interpreter)."""
    cfg = config.get_text_config(decoder=True)
    kind = getattr(cfg, "model_type", None)
    if kind not in _KERNEL_MODEL_TYPES:
        return f"model_type {kind!r} is not among the families the kernel was checked on"
    if config._attn_implementation not in ("sdpa", "eager"):
        return f"config._attn_implementation={config._attn_implementation!r} (the static path runs sdpa or eager)"
    if getattr(cfg, "attn_logit_softcapping", None):
        return f"config.attn_logit_softcapping={cfg.attn_logit_softcapping!r} (the kernel has no soft-cap)"
    heads, kv, _ = _head_layout(config)
    if heads % kv:
        return f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
    return None


@functools.cache
def _kernel_checks_out(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                       block_size: int) -> str | None:
    """Once per process and shape: the kernel against ``paged_attention_reference`` on a random pool of the
    model's head layout and cache dtype, on the device (compiling it). None when they agree; else why not, and
    "auto" gathers instead: a kernel that fails to build or disagrees on a new GPU or Triton costs speed, not
    correctness."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows, blocks = 3, 2 * (-(-130 // block_size))  # lengths past two 64-column tiles
    q = torch.randn(rows, heads, head_dim, generator=gen, device=device).to(dtype)
    k, v = (torch.randn(blocks * block_size, kv_heads, head_dim, generator=gen, device=device).to(dtype)
            for _ in range(2))
    table = torch.randperm(blocks, generator=gen, device=device)[: rows * (blocks // 2)].view(rows, -1)  # (3, nb)
    lengths = torch.tensor([1, block_size + 3, 130], device=device)
    try:
        got = paged_attention(q, k, v, table, lengths, scale=head_dim ** -0.5, block_size=block_size).float()
    except Exception as err:  # a compile or launch failure on this machine: report it, take the gathered path
        return f"the kernel failed here: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    want = paged_attention_reference(q, k, v, table, lengths, scale=head_dim ** -0.5, block_size=block_size).float()
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # 2-byte products: p is rounded to the pool's dtype, as sdpa's
    err = (got - want).abs().max().item()
    return None if err <= tol else f"the kernel disagrees with the reference here: max |d| {err:.3g} > {tol}"


def resolve_attention(attention: str, model, device: torch.device, *, dtype: torch.dtype | None = None,
                      block_size: int = 16) -> tuple[str, str]:
    """sample()'s ``attention`` resolved for the static path on this model and device (departure 18): ("kernel",
    why) or ("gather", why). "kernel" where the kernel cannot run raises a ValueError saying why; "auto" takes the
    kernel on CUDA when Triton imports, the model's family is checked (``paged_kernel_blocker``) and the kernel
    agrees with the reference on this machine (``_kernel_checks_out``, once per process), else gathers.
    dtype: the pool's (default the model's parameters')."""
    if attention == "gather":
        return "gather", "asked"
    if attention not in ("auto", "kernel"):
        raise ValueError(f"sampler.py sample(): attention must be 'auto', 'kernel' or 'gather', got {attention!r}")
    device = torch.device(device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    why = paged_kernel_blocker(model.config)
    if why is None and triton is None:
        why = "Triton is not installed"
    if why is None and device.type != "cuda" and not (attention == "kernel" and interpreted):
        why = f"the device is {device.type} (the kernel runs on CUDA; on CPU only under TRITON_INTERPRET=1)"
    if why is None and device.type == "cuda":
        why = _kernel_checks_out(str(device), dtype or next(model.parameters()).dtype,
                                 *_head_layout(model.config), block_size)
    if why is None:
        AttentionInterface.register(_KERNEL_ATTENTION, _kernel_attention)  # idempotent: a dict entry
        return "kernel", "checked"
    if attention == "kernel":
        raise ValueError(f"sampler.py sample(): attention='kernel' cannot run: {why}; use 'auto' or 'gather'")
    return "gather", why


def _kernel_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function interface over the paged pool (departure 18): ``key`` and ``value`` are
    the layer's whole pools (N, h, d), as ``_PagedCache.update`` returns them in kernel mode, and the cache rides
    in ``kwargs["paged_kv"]`` (the static step passes it to the model's forward, which hands its kwargs down).
    query (R, H, 1, d); returns ((R, 1, H, d), None) as sdpa's function does. Anything that would change the
    result and the kernel does not do (a soft-cap, sinks, dropout, more than one query token) raises."""
    cache = kwargs.get("paged_kv")
    assert cache is not None, "the kernel attention runs only inside the static step, which passes paged_kv"
    for name in ("softcap", "s_aux", "sinks"):
        assert kwargs.get(name) is None, f"{type(module).__name__} passes {name}: not a family the kernel serves"
    assert query.shape[2] == 1 and dropout == 0.0, "one query token per slot, no dropout"
    rows = query.shape[0]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(query.squeeze(2), key, value, cache.table[:rows], cache.lens[:rows], scale=scale,
                          block_size=cache.block_size)  # (R, H, d)
    return out.unsqueeze(1), None  # (R, 1, H, d)


# ------------------------------------------------------------------------------------------------
# Sampler, part 4: the static-shape path. S slots over a paged KV pool: each slot's row owns blocks of
# ``block_size`` token rows, listed in a device block table; a decode step always runs all S slots over W gathered
# columns (a width bucket), so its shapes never change and CUDA can replay it as a graph (one per bucket). The host
# hands out blocks at admission and at each host read, preempts the newest rows when the pool runs dry, and
# prefills refills (right-padded, eager).
# ------------------------------------------------------------------------------------------------


# The static step's width buckets: it attends over the first W columns of every slot, W the smallest of L / 8, L / 4,
# L / 2 and L (rounded up to whole blocks) that holds the longest running row until the next host read (departure 10).
_WIDTH_FRACTIONS = (8, 4, 2, 1)


@dataclass
class PoolPlan:
    """How the static path's K/V memory is cut (departure 13): S slots, ``blocks`` usable blocks of ``block_size``
    tokens (plus one trash block), ``length`` = L columns each slot's attention reads, ``copies`` the transient
    copies of a layer's gathered K/V a step makes (``transient_copies``)."""

    slots: int
    blocks: int
    block_size: int
    length: int
    copies: int = 1


def transient_copies(config) -> int:
    """Copies of one layer's K/V that a static step holds at once, in units of the gathered (S, kv_heads, W, d):
    the gather, and for grouped-query attention transformers' copy to every query head (``repeat_kv``, which sdpa
    with a mask and eager attention run; n_rep = heads / kv_heads, no copy when it is 1). transformers 5.25's sdpa
    folds the query heads onto the KV heads for one query token instead (no copy): counting the copy anyway keeps
    the gathered path within its budget on every version and under eager attention, at the price of slots."""
    heads, kv, _ = _head_layout(config)
    n_rep = heads // kv
    return 1 + (n_rep if n_rep > 1 else 0)


def pool_plan(*, slots: int, length: int, expected: int, block_size: int, token_bytes: int, layers: int,
               budget: int | None, copies: int = 1) -> PoolPlan | None:
    """The static path's slots and pool for a byte budget (departure 13), or None when the budget holds no row.

    slots: rows in flight at most (max_batch_size, or the prompt count); length: L = longest prompt +
    max_new_tokens; expected: the columns a row holds at expected lengths (mean prompt + half of max_new_tokens +
    sync_every, as plan.py assumes); token_bytes: one token's K and V over all layers. The budget pays for the pool,
    (blocks + 1) x block_size x token_bytes, and for one layer's K and V gathered for the attention and its copies,
    copies x S x L x token_bytes / layers (transient, one layer at a time; copies from ``transient_copies``). S is
    cut so that the pool holds S rows at expected lengths (each slot's transient is paid whether its row is long or
    short, so slots beyond those rows would only shrink the pool) and one row at full length; the pool takes the
    rest, never more than S full-length rows. budget None: S slots and S full-length rows of blocks."""
    width = -(-length // block_size)  # blocks of a row at full length
    if budget is None:
        return PoolPlan(slots, slots * width, block_size, length, copies)
    block_bytes = block_size * token_bytes
    gather = copies * (length * token_bytes // layers)  # one slot's gathered K and V of one layer, and their copies
    typical = -(-min(expected, length) // block_size) * block_bytes  # a row at expected lengths
    if budget < (width + 1) * block_bytes:  # not one row at full length with the trash block
        return None
    by_gather = (budget - (width + 1) * block_bytes) // gather if gather else slots  # the kernel gathers nothing
    fit = min(slots, by_gather, (budget - block_bytes) // (gather + typical))
    if fit < 1:
        return None
    blocks = min((budget - fit * gather) // block_bytes - 1, fit * width)
    return PoolPlan(int(fit), int(blocks), block_size, length, copies)


class _PagedCache:
    """The cache object handed to the model's attention layers in a static decode step (duck-typed: transformers'
    attention modules only call ``update``), and the host's allocator of its blocks.

    Per layer, keys/values pools (blocks + 1) x block_size token rows of (kv_heads, head_dim) in ``dtype`` (None:
    the dtype of the first prefill's K and V); block ``blocks`` is the trash block, where free slots and the
    columns no row owns point. ``table`` (S, L / block_size) on the device: the pool block of each slot's j-th block
    of columns; column c of slot s lives at token row table[s, c // bs] * bs + c % bs. write_pos (S,): the column
    where each slot's current token goes (= tokens already cached in that slot). The host keeps each slot's blocks
    and the free list (Python lists: no tensor op per block); it copies the table to the device only between steps
    (``sync``), so a step reads nothing from the host. ``begin_step`` computes, once per step for every layer, the pool
    row each slot's new K/V goes to."""

    def __init__(self, plan: PoolPlan, device, dtype: torch.dtype | None = None, *, kernel: bool = False):
        self.slots, self.length, self.block_size, self.dtype = plan.slots, plan.length, plan.block_size, dtype
        self.copies = plan.copies
        self.kernel = kernel  # departure 18: update returns the pools, the kernel reads them in place
        self.blocks, self.trash = plan.blocks, plan.blocks
        self.keys, self.values = [], []
        width = -(-plan.length // plan.block_size)
        self.table_host = [[self.trash] * width for _ in range(plan.slots)]  # (S, L / bs) host lists
        self.table = torch.tensor(self.table_host, dtype=torch.long, device=device)  # (S, L / bs)
        self.write_pos = torch.zeros(plan.slots, dtype=torch.long, device=device)  # (S,)
        cols = torch.arange(plan.length, device=device)  # (L,)
        self.col_block, self.col_off = cols // plan.block_size, cols % plan.block_size  # (L,), (L,)
        self.read_idx = self._read_index()  # (S, L) pool row of every column of every slot
        self.width = plan.length  # W: the columns a step gathers and attends over (a width bucket, <= L)
        self.rows = plan.slots  # R: the slots a step runs (a slot-count bucket; the occupied slots are the first)
        self.dest = torch.zeros(plan.slots, dtype=torch.long, device=device)  # (S,) pool row of this step's K/V
        self.owned: list[list[int]] = [[] for _ in range(plan.slots)]  # host: each slot's blocks, in column order
        self.live = torch.zeros(plan.slots, dtype=torch.bool, device=device)  # (S,) slots that own blocks (a row)
        self.lens = torch.ones(plan.slots, dtype=torch.long, device=device)  # (S,) columns the kernel reads per slot
        self.free = list(range(plan.blocks))[::-1]  # host: free blocks; pop() gives the lowest first
        self.peak = 0  # most blocks in use at once

    def _read_index(self) -> torch.Tensor:
        return self.table.index_select(1, self.col_block) * self.block_size + self.col_off  # (S, L)

    def blocks_for(self, columns: int) -> int:
        """Blocks that hold a row's first `columns` columns (at most L: writes past L - 1 are clamped to it)."""
        return -(-min(columns, self.length) // self.block_size)

    def grow(self, slot: int, columns: int) -> None:
        """Give `slot` blocks until its first `columns` columns have one (the caller checked there are enough)."""
        mine = self.owned[slot]
        for _ in range(self.blocks_for(columns) - len(mine)):
            mine.append(self.free.pop())
            self.table_host[slot][len(mine) - 1] = mine[-1]
        self.peak = max(self.peak, self.blocks - len(self.free))

    def release(self, slot: int) -> None:
        """Return `slot`'s blocks to the free list; its columns point at the trash block again."""
        self.free.extend(self.owned[slot][::-1])
        self.owned[slot] = []
        self.table_host[slot] = [self.trash] * len(self.table_host[slot])

    def sync(self) -> None:
        """Copy the host's table to the device and recompute the read index, in place (a captured step reads both
        buffers): one host-to-device copy, at a host read, never inside a step."""
        self.table.copy_(torch.tensor(self.table_host, dtype=torch.long))
        self.live.copy_(torch.tensor([bool(mine) for mine in self.owned]))
        if not self.kernel:
            self.read_idx.copy_(self._read_index())

    def load(self, slots: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]], lens: list[int]) -> None:
        """Copy right-padded prefill K/V, per layer (b, h, P, d) (or (1, h, P, d) expanded to b rows), into the
        blocks of `slots` (host list, b; their blocks given and synced): row i's columns [0, lens[i])."""
        device, bs = self.write_pos.device, self.block_size
        pairs = [(i, c) for i, n in enumerate(lens) for c in range(n)]  # (row, column) of every real token
        dest = torch.tensor([self.table_host[slots[i]][c // bs] * bs + c % bs for i, c in pairs],
                            dtype=torch.long, device=device)  # (n_tok,) pool rows
        src_row, src_col = torch.tensor(pairs, dtype=torch.long, device=device).t()  # (n_tok,), (n_tok,)
        for i, (k, v) in enumerate(kv):
            if i == len(self.keys):  # first load: allocate with the K/V's own head count, size and dtype
                shape = ((self.blocks + 1) * self.block_size, k.shape[1], k.shape[3])
                self.keys.append(k.new_zeros(shape, dtype=self.dtype or k.dtype))
                self.values.append(v.new_zeros(shape, dtype=self.dtype or v.dtype))
            # (b, h, P, d) -> (n_tok, h, d): each row's real columns
            self.keys[i].index_copy_(0, dest, k[src_row, :, src_col].to(self.keys[i].dtype))
            self.values[i].index_copy_(0, dest, v[src_row, :, src_col].to(self.values[i].dtype))
        self.write_pos.index_copy_(0, torch.tensor(slots, dtype=torch.long, device=device),
                                   torch.tensor(lens, dtype=torch.long, device=device))

    def pool_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def gather_bytes(self) -> int:
        """The most one layer's transient K/V take at S x L: the gather of ``update``, (S, h, L, d) each, with the
        copies transformers makes of it (``PoolPlan.copies``)."""
        return self.copies * max((k[0].numel() * k.element_size() + v[0].numel() * v.element_size()) * self.slots
                                 * self.length for k, v in zip(self.keys, self.values))

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        """Write one step's K/V (S, h, 1, d) at each slot's write_pos (through its block), and return every slot's
        first W columns gathered through the table: (S, h, W, d) each, a transient copy of one layer's columns
        (freed when the layer's attention is done); columns a row does not own read the trash block, masked out."""
        k_pool, v_pool = self.keys[layer_idx], self.values[layer_idx]
        if key_states.dtype != k_pool.dtype:
            key_states = key_states.to(k_pool.dtype)
        if value_states.dtype != v_pool.dtype:
            value_states = value_states.to(v_pool.dtype)
        dest = self.dest[: self.rows]  # (R,)
        k_pool.index_copy_(0, dest, key_states.squeeze(2))  # (R, h, d) rows; free slots: in the trash block
        v_pool.index_copy_(0, dest, value_states.squeeze(2))
        if self.kernel:  # departure 18: the kernel reads each slot's columns in place, through the table
            return k_pool, v_pool  # (N, h, d) each
        return k_pool[self.read].transpose(1, 2), v_pool[self.read].transpose(1, 2)  # (R, h, W, d)

    def begin_step(self) -> None:
        """Once per step, before the layers: the pool row of each of the first R slots' column write_pos, and the
        (R, W) view of the read index at this step's bucket (nothing read on the host)."""
        pos = self.write_pos[: self.rows]  # (R,)
        block = self.table[: self.rows].gather(1, torch.div(pos, self.block_size, rounding_mode="floor")[:, None])
        torch.add(block.squeeze(1) * self.block_size, pos % self.block_size, out=self.dest[: self.rows])  # (R,)
        if self.kernel:  # a row reads its cached columns and this one; a free slot one trash column
            torch.add(pos, 1, out=self.lens[: self.rows]).masked_fill_(~self.live[: self.rows], 1)  # (R,)
        else:
            self.read = self.read_idx[: self.rows, : self.width]  # (R, W)

    def move(self, src: int, dst: int) -> None:
        """Slot src's row goes to the free slot dst: its blocks and table row move (the K/V stays where it is)."""
        self.owned[dst], self.owned[src] = self.owned[src], []
        self.table_host[dst], self.table_host[src] = self.table_host[src], [self.trash] * len(self.table_host[src])


class _StaticStep:
    """One decode step over all S slots from fixed buffers: draw each slot's next token from ``hidden`` (S, H) (its
    log-prob and end recorded by ``_Run.draw``), then run the model on those tokens at ``positions`` (S, 1), writing
    their K/V at ``cache.write_pos`` (S,), into the next ``hidden``. Nothing reads the host: on CUDA the whole step
    is captured once as a CUDA graph and replayed (the draw inside it; for top-p < 1, whose nucleus search may sort
    on the host's word, the draw runs eagerly before the replay of the forward). Elsewhere it runs eagerly: the same
    computation, which is what the CPU parity tests check. A step runs the first R slots (the occupied ones are kept
    first) over their first W columns, (R, W) one of a few slot-count and width buckets the host picks between
    steps; CUDA captures one graph per pair used, all in one memory pool."""

    def __init__(self, model, base, cache: _PagedCache, run: _Run, device):
        self.base, self.cache, self.run, self.cache_arg = base, cache, run, _cache_kwarg(base)
        slots = cache.slots
        self.tokens = torch.zeros(slots, 1, dtype=torch.long, device=device)  # (S, 1) each slot's latest token
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=device)  # (S, 1)
        self.slot_row = torch.full((slots,), run.trash, dtype=torch.long, device=device)  # (S,) row of each slot
        self.n_out = torch.zeros(slots, dtype=torch.long, device=device)  # (S,) tokens each slot's row has drawn
        self.hidden = None  # (S, H) the state that predicts each slot's next token; allocated by the first admit,
        # in the dtype the model's forward returns (float32 under autocast with float32 weights), before any capture
        self.columns = torch.arange(cache.length, device=device)  # (L,)
        # departure 18: the kernel masks by each slot's length; transformers still wants a 4D mask to pass through
        self.no_mask = torch.ones(slots, 1, 1, 1, dtype=torch.bool, device=device)  # (S, 1, 1, 1)
        self.config = model.config
        # eager attention adds its mask to the scores; sdpa takes a boolean one
        self.additive = model.config._attn_implementation == "eager"
        self.dtype = next(model.parameters()).dtype
        self.neg = torch.finfo(self.dtype).min
        self.use_graph = torch.device(device).type == "cuda"
        # the draw is capturable (no host read) except top-p's nucleus search, which may sort a row whole
        self.draw_inside = run.temperature == 0 or run.top_p == 1.0
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # (R, W) -> its captured step
        self.steps_at: dict[tuple[int, int], int] = {}  # (R, W) -> decode steps run at it (stats)
        self.capture_seconds = 0.0  # wall time of the warm-ups and captures (stats)

    def _draw(self) -> None:
        n = self.cache.rows
        tokens = self.run.draw(self.hidden[:n], self.slot_row[:n], self.n_out[:n])  # (R,)
        self.tokens[:n].copy_(tokens.unsqueeze(1))
        self.n_out[:n].add_(1)

    def _forward(self) -> None:
        n, width = self.cache.rows, self.cache.width
        pos = self.cache.write_pos[:n]  # (R,)
        self.cache.begin_step()
        extra = {}
        if self.cache.kernel:  # departure 18: the registered kernel attention, the cache handed down in kwargs
            mask, extra = self.no_mask[:n], {"paged_kv": self.cache}
        else:
            # (R, W): cached columns + this one (a free slot clamped past W attends over trash: its draws are discarded)
            allowed = self.columns[:width].unsqueeze(0) <= pos.unsqueeze(1)
            mask = allowed[:, None, None, :]  # (R, 1, 1, W)
            if self.additive:
                mask = torch.zeros(mask.shape, dtype=self.dtype, device=mask.device).masked_fill_(~mask, self.neg)
        own = self.config._attn_implementation
        if self.cache.kernel:
            self.config._attn_implementation = _KERNEL_ATTENTION  # read by every attention module as it runs
        try:
            hidden = self.base(
                input_ids=self.tokens[:n], attention_mask=mask, position_ids=self.positions[:n], use_cache=True,
                **{self.cache_arg: self.cache}, **extra,
            ).last_hidden_state[:, -1]  # (R, H)
        finally:
            self.config._attn_implementation = own
        self.hidden[:n].copy_(hidden)
        # a free slot, or a row past its end, keeps counting: clamp inside the columns and the position table (a
        # running row never gets there: its prompt + max_new_tokens columns fit)
        last = self.cache.length - 1
        self.positions[:n].add_(1).clamp_(max=last)
        pos.add_(1).clamp_(max=last)

    def _captured(self) -> None:
        """What the graph records: the whole step, or only its forward when the draw cannot be captured."""
        if self.draw_inside:
            self._draw()
        self._forward()

    def _state(self) -> list[torch.Tensor]:
        """The buffers a step changes besides the K/V and the draws' outputs (which a rerun of the same step
        overwrites with the same values)."""
        run = self.run
        return [self.tokens, self.positions, self.n_out, self.hidden, self.cache.write_pos, run.end_len, run.end_eos]

    def warm_up(self) -> None:
        """Run the step twice (lazy initialisations, the allocator; on a side stream on CUDA) and restore the state
        after each, so the step that follows computes exactly what it would have without the warm-up."""
        saved = [t.clone() for t in self._state()]
        cuda = self.use_graph
        side = torch.cuda.Stream() if cuda else None
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
            for _ in range(2):
                self._captured()
                for t, v in zip(self._state(), saved):
                    t.copy_(v)
        if cuda:
            torch.cuda.current_stream().wait_stream(side)

    def move(self, src: list[int], dst: list[int]) -> None:
        """The rows of slots `src` go to the free slots `dst` (host lists): each per-slot buffer's entries copied
        (the cache's table rows are moved by ``_PagedCache.move``); the src slots then draw into the trash row."""
        device = self.tokens.device
        src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst))
        for buf in (self.tokens, self.positions, self.slot_row, self.n_out, self.hidden, self.cache.write_pos):
            buf.index_copy_(0, dst_t, buf.index_select(0, src_t))
        self.slot_row.index_fill_(0, src_t, self.run.trash)

    def __call__(self, rows: int, width: int) -> None:
        """One step of the first `rows` slots (a bucket holding every occupied slot) with the attention over their
        first `width` columns (a bucket; every running row's columns up to the next host read lie below it)."""
        self.cache.rows, self.cache.width = rows, width
        key = (rows, width)
        self.steps_at[key] = self.steps_at.get(key, 0) + 1
        if self.use_graph and key not in self.graphs:
            torch.cuda.synchronize()  # a capture is rare (once per bucket per call): its time is worth a sync
            t0 = time.perf_counter()
            self.warm_up()
            pool = next(iter(self.graphs.values())).pool() if self.graphs else None  # one pool for all buckets
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # records, runs nothing
                self._captured()
            self.graphs[key] = graph
            torch.cuda.synchronize()
            self.capture_seconds += time.perf_counter() - t0
        if not self.draw_inside:
            self._draw()
        if key in self.graphs:
            self.graphs[key].replay()
        else:
            self._captured()


def _prefill_right(model, base, run: _Run, seqs: list[list[int]], pad_token_id: int) -> tuple[DynamicCache,
                                                                                              torch.Tensor, list[int]]:
    """One forward over the right-padded token lists `seqs` (prompts, or a preempted row's prompt + its drawn
    tokens): (cache with K/V at columns [0, len), hidden (b, H) at each row's last token, lens: host list (b,))."""
    device = run.head.weight.device
    lens = [len(s) for s in seqs]
    width = max(lens)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)  # (b, P)
    for i, s in enumerate(seqs):
        ids[i, : lens[i]] = torch.tensor(s, dtype=torch.long)
    attn = torch.arange(width).unsqueeze(0) < torch.tensor(lens).unsqueeze(1)  # (b, P)
    cache = _StoredCache(config=model.config, kv_dtype=run.kv_dtype)
    hidden = base(
        input_ids=ids.to(device), attention_mask=attn.to(device), use_cache=True, **{_cache_kwarg(base): cache},
    ).last_hidden_state  # (b, P, H); right padding: default positions 0..len-1 are the real ones
    run.forward_calls += 1
    run.prefill_tokens += sum(lens)
    last = torch.tensor(lens, device=device) - 1  # (b,)
    return cache, hidden[torch.arange(len(seqs), device=device), last], lens  # (b, H) at the last token


def _load_shared(model, base, run: _Run, cache: _PagedCache, slots: list[int], rows: list[int],
                 pad_token_id: int) -> tuple[torch.Tensor, list[int]]:
    """The static path's prefill with one prefill per distinct prompt (departure 11): the distinct prompts not in
    ``run.stash`` (prompt key -> its K/V per layer (1, h, len, d) and hidden (1, H), kept while copies are queued)
    go through one forward; each prompt's K/V is then copied into the blocks of all its rows' slots. Returns the
    rows' hidden states (b, H) at their last prompt token and their lengths (host list, b)."""
    keys = run.share(rows)
    new = [k for k in dict.fromkeys(keys) if k not in run.stash]
    if new:
        pre_cache, pre_hidden, _ = _prefill_right(model, base, run, [run.prompts[k] for k in new], pad_token_id)
        for i, k in enumerate(new):
            n = len(run.prompts[k])
            run.stash[k] = ([(layer.keys[i : i + 1, :, :n], layer.values[i : i + 1, :, :n])
                             for layer in pre_cache.layers], pre_hidden[i : i + 1])
    for k in dict.fromkeys(keys):
        kv, _ = run.stash[k]
        mine = [s for s, key in zip(slots, keys) if key == k]
        cache.load(mine, [(kk.expand(len(mine), -1, -1, -1), vv.expand(len(mine), -1, -1, -1)) for kk, vv in kv],
                   [len(run.prompts[k])] * len(mine))
    hidden = torch.cat([run.stash[k][1] for k in keys])  # (b, H)
    for k in dict.fromkeys(keys):
        if run.pending[k] == 0:
            del run.stash[k]
        elif k in new:  # a view would keep the whole prefill's K/V alive: keep a copy of this prompt's only
            kv, h = run.stash[k]
            run.stash[k] = ([(kk.clone(), vv.clone()) for kk, vv in kv], h.clone())
    return hidden, [len(run.prompts[k]) for k in keys]


def _kv_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype the sampler caches K and V in (departure 13): autocast's when it is on for the device, else None."""
    return torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None


def _kv_token_bytes(model, kv_dtype: torch.dtype | None) -> int:
    """Bytes of one token's K and V over all layers, from the config (the static path's sizing before any forward;
    the tests check it against the stored tensors): 2 x layers x kv_heads x head_dim x element size."""
    _, kv_heads, head_dim = _head_layout(model.config)
    layers = model.config.get_text_config(decoder=True).num_hidden_layers
    dtype = kv_dtype or next(model.parameters()).dtype
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def _decode_static(model, base, run: _Run, pad_token_id: int, plan: PoolPlan, kernel: bool = False) -> None:
    """The static-shape decode loop: same schedule as the default path, slots instead of a shrinking batch, and the
    pool's blocks handed out by the host at each read (admission by free blocks, recompute preemption)."""
    device = run.head.weight.device
    cache = _PagedCache(plan, device, run.kv_dtype, kernel=kernel)
    decode = _StaticStep(model, base, cache, run, device)
    free = list(range(plan.slots))[::-1]  # free slot ids (host); pop() gives the lowest first
    active: list[int] = []  # occupied slot ids (host), in admission order
    row_of, start_of, prompt_of = {}, {}, {}  # host: slot -> prompt index, step before its row's first draw (so
    # step - start = tokens drawn, counting those before a preemption), prompt length
    drawn: dict[int, list[int]] = {}  # preempted rows waiting to come back -> the tokens they had drawn
    run.stash = {}  # departure 11: prompt key -> its prefilled K/V, while copies of it are queued
    step = 0
    bs, length = plan.block_size, plan.length
    widths = sorted({min(length, -(-length // (f * bs)) * bs) for f in _WIDTH_FRACTIONS})  # the buckets, ascending
    if kernel:  # departure 18: the kernel reads each row's own columns; a width bucket would only add graphs
        widths = [length]
    # slot-count buckets: multiples of S / 8 (the rows in flight, not a power of two, set the step's size)
    step_rows = -(-plan.slots // max(_WIDTH_FRACTIONS))
    counts = sorted({min(plan.slots, k * step_rows) for k in range(1, max(_WIDTH_FRACTIONS) + 1)})
    width, n_run = length, plan.slots

    def written(s: int) -> int:  # columns slot s has written: its prompt, then one per token drawn
        return prompt_of[s] + step - start_of[s]

    def admit(rows: list[int]) -> None:
        slots = [free.pop() for _ in rows]
        back = [i for i, r in enumerate(rows) if r in drawn]  # preempted rows: prompt + their tokens, unshared
        fresh = [i for i, r in enumerate(rows) if r not in drawn]
        done = [len(drawn[rows[i]]) for i in back]
        seqs = [run.prompts[rows[i]] + drawn.pop(rows[i]) for i in back]
        for i, s in enumerate(slots):
            cache.grow(s, (len(seqs[back.index(i)]) if i in back else len(run.prompts[rows[i]])) + run.sync_every)
        parts, lens = [], [0] * len(rows)
        if fresh and run.keys is not None:
            hid, n = _load_shared(model, base, run, cache, [slots[i] for i in fresh], [rows[i] for i in fresh],
                                  pad_token_id)
            parts.append(hid)
        elif fresh:
            pre_cache, hid, n = _prefill_right(model, base, run, [run.prompts[rows[i]] for i in fresh], pad_token_id)
            cache.load([slots[i] for i in fresh], [(layer.keys, layer.values) for layer in pre_cache.layers], n)
            parts.append(hid)
        for i, m in zip(fresh, n if fresh else []):
            lens[i] = m
        if back:
            pre_cache, hid, n = _prefill_right(model, base, run, seqs, pad_token_id)
            cache.load([slots[i] for i in back], [(layer.keys, layer.values) for layer in pre_cache.layers], n)
            parts.append(hid)
            for i, m in zip(back, n):
                lens[i] = m
        order = fresh + back
        pre_hidden = torch.cat(parts)[torch.tensor([order.index(i) for i in range(len(rows))], device=device)]  # (b,H)
        if not run.kv_bytes_per_token:  # (the pool seen as (1, h, N, d))
            run.note_cache([(k.unsqueeze(0).transpose(1, 2), v.unsqueeze(0).transpose(1, 2))
                            for k, v in zip(cache.keys, cache.values)])
        slots_t = torch.tensor(slots, dtype=torch.long, device=device)  # (b,)
        had = [0] * len(rows)  # tokens each row drew before (a comeback's), 0 for a fresh row
        for i, d in zip(back, done):
            had[i] = d
        decode.positions.index_copy_(0, slots_t, torch.tensor(lens, device=device).unsqueeze(1))
        decode.slot_row.index_copy_(0, slots_t, torch.tensor(rows, dtype=torch.long, device=device))
        decode.n_out.index_copy_(0, slots_t, torch.tensor(had, dtype=torch.long, device=device))
        if decode.hidden is None:
            decode.hidden = pre_hidden.new_zeros(plan.slots, pre_hidden.shape[1])  # (S, H)
        decode.hidden.index_copy_(0, slots_t, pre_hidden)
        active.extend(slots)
        for s, r, m, c in zip(slots, rows, lens, had):
            # a comeback has drawn c tokens already: its prefill held prompt + c columns, its counter starts at c
            row_of[s], prompt_of[s], start_of[s] = r, m - c, step - c

    def leave(slots: list[int]) -> None:  # the slots' rows are gone: free slots draw into the trash row
        decode.slot_row.index_fill_(0, torch.tensor(slots, dtype=torch.long, device=device), run.trash)
        for s in slots:
            cache.release(s)
        free.extend(sorted(slots, reverse=True))

    def schedule() -> None:
        """At a host read: top up every running row's blocks for the columns it writes before the next read
        (sync_every steps at most), preempting the newest rows while the pool cannot; compact the occupied slots;
        admit waiting rows in order while a slot and their blocks (prompt + sync_every columns) are free; copy the
        table to the device; pick the slot-count bucket that holds the occupied slots and the width bucket that
        holds every running row's columns until the next read."""
        nonlocal active, width, n_run
        short = lambda: sum(cache.blocks_for(written(s) + run.sync_every) - len(cache.owned[s]) for s in active)
        out = []
        while short() > len(cache.free):
            assert len(active) > 1, "the pool holds one row at full length (pool_plan), so the oldest row fits"
            s = active.pop()  # vLLM's recompute preemption: the newest row goes back to the front of the queue
            cache.release(s)
            r, n = row_of[s], step - start_of[s]
            drawn[r] = run.out_tokens[r, :n].tolist() if n else []  # a device read, only when preempting
            run.queue.append(r)
            run.preemptions += 1
            out.append(s)
        if out:
            leave(out)
        compact()
        for s in active:
            cache.grow(s, written(s) + run.sync_every)
        take, left, by_blocks = [], len(cache.free), False
        while run.queue and len(take) < len(free):
            r = run.queue[-1]
            need = cache.blocks_for(len(run.prompts[r]) + len(drawn.get(r, ())) + run.sync_every)
            if need > left:
                by_blocks = True
                break
            take.append(run.queue.pop())
            left -= need
        # a refill costs a prefill call: while rows run, wait for min_refill free slots (as _Run.take), unless the
        # pool is what limits it (waiting would not make the refill bigger)
        if active and not by_blocks and len(take) < min(run.min_refill, len(take) + len(run.queue)):
            run.queue.extend(take[::-1])
            take = []
        if take:
            admit(take)
        cache.sync()
        need = max((written(s) + run.sync_every for s in active), default=1)
        width = next(w for w in widths if w >= min(need, length))
        n_run = next(c for c in counts if c >= len(active))  # the occupied slots are 0 .. len(active) - 1
        assert not active or max(active) < n_run, f"occupied slots {sorted(active)} past the {n_run} a step runs"

    def compact() -> None:
        """Rows in slots past the first len(active) move into the free slots below (the block table rows and the
        per-slot state move; no K/V is copied), so a step of the first R slots runs every occupied one."""
        if decode.hidden is None:
            return
        n, taken = len(active), set(active)
        movers = sorted(s for s in active if s >= n)
        holes = [s for s in range(n) if s not in taken]
        assert len(movers) == len(holes), (movers, holes)
        if not movers:
            return
        decode.move(movers, holes)
        to = dict(zip(movers, holes))
        for a, b in to.items():
            cache.move(a, b)
            row_of[b], start_of[b], prompt_of[b] = row_of.pop(a), start_of.pop(a), prompt_of.pop(a)
        active[:] = [to.get(s, s) for s in active]  # admission order kept
        free[:] = sorted(set(range(plan.slots)) - set(active), reverse=True)

    schedule()
    assert active, "the first admission takes at least one row: the pool holds one at full length"
    since = 0  # decode steps since the last host read
    cached = sum(written(s) for s in active)  # the running rows' columns before this step (stats; host arithmetic)
    while active:
        decode(n_run, width)  # the first n_run slots draw, then the model runs on them (a graph replay on CUDA)
        run.columns_real += cached + len(active)  # each running row attends over its cached columns and this one
        cached += len(active)
        run.forward_calls += 1
        run.decode_steps += 1
        run.in_flight += len(active)
        run.in_flight_peak = max(run.in_flight_peak, len(active))
        step += 1
        since += 1
        # departure 16: ended rows are read every sync_every steps, or once every row has drawn max_new_tokens
        if since >= run.sync_every or step - max(start_of[s] for s in active) >= run.max_new_tokens:
            act = torch.tensor(active, dtype=torch.long, device=device)  # (A,)
            flags = run.check([row_of[s] for s in active], decode.slot_row[act], [step - start_of[s] for s in active],
                              since)
            since = 0
            done = [s for s, d in zip(active, flags) if d]
            if done:
                leave(done)
                active = [s for s, d in zip(active, flags) if not d]
            schedule()
            cached = sum(written(s) for s in active)
    run.blocks_peak, run.blocks_left = cache.peak, cache.blocks - len(cache.free)
    run.pool_bytes, run.gather_bytes = cache.pool_bytes(), cache.gather_bytes()
    run.bucket_steps = dict(sorted(decode.steps_at.items()))
    run.graphs, run.capture_seconds = len(decode.graphs), decode.capture_seconds
    run.width_steps, run.rows_steps = {}, {}
    for (r, w), n in decode.steps_at.items():
        run.width_steps[w] = run.width_steps.get(w, 0) + n
        run.rows_steps[r] = run.rows_steps.get(r, 0) + n
    run.width_steps, run.rows_steps = dict(sorted(run.width_steps.items())), dict(sorted(run.rows_steps.items()))

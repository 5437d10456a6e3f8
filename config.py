"""GRAFT's configuration: one dataclass whose defaults are the paper's (arXiv 2609.37868).

Every field's docstring (the string under it) is also its --help line: graft.py builds the CLI from
this class (graft.build_parser, flags = field names with dashes) and FLAGS.md from both. Checks that
need more than one field, or the file system, are graft.validate_config's.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Config:
    # --- model and data
    model: str = ""
    """Hub id or local folder of the transformers causal LM that this process trains (required)."""
    name: str = "a"
    """This side's name: its rollout files go to <exchange>/<name>/. Use 'a'/'b' or the model name."""
    prompts: str = "data/math_train.jsonl"
    """Training prompt JSONL: one {"id", "problem", "answer"} object per line (data/prepare.py writes it)."""
    strict: bool = False
    """Stop at start when a gold answer of --prompts cannot be read by verify.py (default: a warning listing them)."""
    out: str = "runs/default"
    """Run directory: metrics.jsonl, checkpoints/, and the exchange dir unless --peer-exchange is set."""
    prompt_template: str = "{problem} Let's think step by step and output the final answer within \\boxed{}."
    """Prompt text; '{problem}' is replaced by the problem (paper's instruction by default; tiny: a short one)."""
    chat_template: bool = False
    """Wrap the prompt text as one user message with the tokenizer's chat template (False = raw text)."""
    trust_remote_code: bool = False
    """Pass trust_remote_code to transformers (off: model repos are untrusted code)."""

    # --- peer (GRAFT); with neither flag this is single-model GRPO ("--peer none")
    peer_exchange: str = ""
    """Online pair: shared exchange dir; this process is side --name, the peer is --peer-name."""
    peer_name: str = "b"
    """The online peer's side name (files <peer-exchange>/<peer-name>/step_*), or several: b,c (our extension)."""
    peer_log: str = ""
    """Stored-trajectory variant: a finished run's rollout-file folder, or a JSONL of foreign trajectories."""
    peer_model: str = ""
    """A JSONL --peer-log without the source's lbar: the model that scores it once (cached beside the file)."""
    exchange_timeout: float = 3600.0
    """Seconds to wait for the peer's rollout file of a step before failing (typ. 600-7200)."""
    peer_dead_after: float = 60.0
    """A waiting side stops when the peer's heartbeat is this many seconds old (killed peer; typ. 60-300)."""
    heartbeat_interval: float = 10.0
    """Seconds between this side's heartbeats in the exchange dir (well under --peer-dead-after)."""
    join_timeout: float = 300.0
    """Seconds a side waits, once its own model is loaded, for each peer to join the run (or a resumed attempt)."""
    run_id: str = ""
    """The pair's run identity ('' = the first side draws one and the second adopts it)."""

    # --- GRPO / GRAFT hyperparameters (paper Table 3)
    steps: int = 174
    """Number of RL steps (paper: 3 epochs of MATH train at 128 prompts = 174)."""
    prompts_per_step: int = 128
    """Prompts (groups) per step, across all ranks (paper 128; tiny 16-64)."""
    n: int = 8
    """Rollouts per prompt (paper 8; baselines 16, 32). Also --rollouts (use that under torchrun)."""
    minibatches: int = 4
    """Optimizer steps per RL step (128 prompts / 32 per minibatch = 4), one epoch over the batch."""
    temperature: float = 1.0
    """Sampling temperature; every log-probability uses the same temperature-scaled logits (Eq. 6)."""
    top_p: float = 1.0
    """Nucleus sampling threshold for rollouts (paper 1.0)."""
    max_prompt_tokens: int = 2048
    """Longest prompt in tokens; a longer prompt is an error (departure 5)."""
    max_response_tokens: int = 4096
    """Response cap; retokenised peer responses longer than this are dropped and counted."""
    stop: list[str] = field(default_factory=list)
    """Stop string, repeatable (--stop $'\\n\\n' --stop 'Q:'): a response ends at the token that completes one."""
    eps_low: float = 0.2
    """Lower PPO clip: ratio floor 1 - eps_low (paper 0.2)."""
    eps_high: float = 0.28
    """Upper PPO clip: ratio ceiling 1 + eps_high (paper 0.28, DAPO clip-higher)."""
    dual_clip: float = 0.0
    """verl's dual-clip constant c for negative advantages (0 = off, the default; verl uses 3.0)."""
    delta: float = 0.8
    """Compatibility floor: peer responses with s <= delta are removed (Eq. 8; 0 = no floor)."""
    compat_norm: str = "token"
    """'token' = mean token log-prob (paper Eq. 6); 'byte' = summed log-prob / UTF-8 bytes (departure 2)."""
    std_normalize: bool = True
    """Divide group advantages by the group std (False = Dr.GRPO)."""
    lr: float = 1e-6
    """AdamW learning rate, constant, no warm-up (paper 1e-6; tiny ~1e-4)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Global grad-norm clip per optimizer step."""

    # --- variants and ablations (README "Baselines and ablations")
    variant: str = "graft"
    """graft | hacpo | sgt | luffy. Without a peer every variant is plain GRPO."""
    order: str = "peer_last"
    """Minibatch order of replaced groups: peer_last (paper) | peer_first | uniform."""
    balance: bool = True
    """Balanced swap; False = every candidate in both directions (ablation)."""
    compat_weight: bool = True
    """Use w = min(s, 1) on peer responses; False = w = 1 for every retained peer response (ablation)."""
    ratio_level: str = "token"
    """token (paper) | sequence (ablation: one length-normalised ratio per response)."""
    selection: str = "graft"
    """graft (Eq. 4 + swap) | random (same count, among prompts whose peer is mixed) | sgt (SGT's rescue rule)."""
    acceptance: str = "gate"
    """gate (compatibility) | random (same acceptance rate, responses drawn at random)."""
    peer_advantages: str = "source"
    """source (peer's own group advantages, paper) | pooled (recomputed over own + peer, 2n)."""
    transfer: str = "all"
    """all (whole peer group, paper) | success (only the peer's correct responses)."""
    sgt_coef: float = 0.1
    """SGT: weight of the NLL term on one correct peer response per rescue prompt."""
    luffy_gamma: float = 0.1
    """LUFFY: shaping constant in f(pi) = pi / (pi + gamma) for peer tokens."""

    # --- system
    seed: int = 0
    """Seed for sampling and minibatch shuffles; both sides of a pair must use the same --data-seed."""
    data_seed: int = 0
    """Seed of the prompt order; the two sides of a pair must agree (checked against the peer's file)."""
    device: str = "auto"
    """auto (cuda if available, else cpu) | cpu | cuda."""
    dtype: str = "auto"
    """auto (fp32 weights + bf16 autocast on GPU, fp32 on CPU) | float32 | bfloat16 (bf16 weights, less memory)."""
    gen_batch_size: int = 256
    """Rows in flight in the sampler at most (bounds the KV cache; finished rows are refilled; typ. 64-512)."""
    static_decode: bool = False
    """Sampler's static-shape decode (preallocated KV cache, CUDA graph on GPU); unmeasured on GPU, so off."""
    share_prefix: bool = True
    """Run each prompt once for its n samples and their log-prob passes (sampler.py departure 11)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward pass inside a minibatch (gradient accumulation)."""
    logprob_chunk: int = 1024
    """Tokens per chunk in the chunked logprob kernel (bounds the logits memory)."""
    fsdp: bool = False
    """Shard weights, gradients and AdamW state over the ranks with FSDP2 (torchrun; models DP cannot fit)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward (saves memory on long responses)."""
    threads: int = 0
    """torch CPU threads (0 = leave torch's default). On a shared CPU, 1 per process is often fastest."""
    verify_workers: int = 0
    """Processes for the verifier (0 = in-process)."""
    save_every: int = 20
    """Checkpoint every this many steps (and at the end); --resume continues from the latest."""
    keep_checkpoints: int = 2
    """How many step checkpoints to keep (the best-by-eval one is kept apart)."""
    report_to: str = "none"
    """Also log metrics live from rank 0: none | tensorboard (<out>/tensorboard) | wandb (optional packages)."""
    resume: bool = False
    """Continue from the newest loadable checkpoint (a pair: relaunch both); a changed run-defining flag is refused."""
    force: bool = False
    """Delete an earlier run in --out (and this side's files in the exchange dir) and start over."""

    # --- evaluation (paper: five benchmarks, T = 0.6, top-p 0.95, avg@8)
    eval_every: int = 0
    """Validate every this many steps (paper 5; 0 = off) and keep the best checkpoint."""
    benchmarks: str = "all"
    """Comma list of math500,aime2024,aime2025,amc23,minerva, 'all', or paths to prompt JSONL files."""
    data_dir: str = "data"
    """Folder with the benchmark JSONL files written by data/prepare.py."""
    eval_samples: int = 8
    """Samples per problem for evaluation (avg@k = pass@1; paper 8)."""
    eval_temperature: float = 0.6
    """Evaluation sampling temperature (paper 0.6)."""
    eval_top_p: float = 0.95
    """Evaluation top-p (paper 0.95)."""
    eval_max_problems: int = 0
    """Use only the first this many problems per benchmark (0 = all; for quick checks)."""
    eval_max_tokens: int = 0
    """Evaluation response cap (0 = max_response_tokens)."""
    save_responses: bool = False
    """Eval: also write every sampled response to the results JSON."""
    eval_out: str = ""
    """Eval: path of the results JSON (default <model>/eval_results.json or <out>/eval/...)."""

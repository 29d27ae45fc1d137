"""Text normalization shared by the index and the query: search terms, error codes, regex anchors."""

from __future__ import annotations

import functools
import os
import re
import signal as _signal

# FTS5's unicode61 tokenizer splits on '_' and punctuation; we split the same way so that what we
# insert and what we query are the same tokens.
_TOKEN_RE = re.compile(r"[^\W_]+")
_HEX_RE = re.compile(r"(?:0x[0-9a-f]+|[0-9a-f]*\d[0-9a-f]*[a-f][0-9a-f]*|[0-9a-f]*[a-f][0-9a-f]*\d[0-9a-f]*)")
_LETTERS_DIGITS_RE = re.compile(r"([a-z]{2,})\d+")

# Words that carry no meaning for matching a problem: English function words and the
# boilerplate of tracebacks and install paths, which every pasted log contains.
STOPWORDS = frozenset("""
a about above after again against all also am an and any are as at be because been before being
below between both but by can could did do does doing down during each few for from further had has
have having he her here hers him his how i if in into is it its itself just me more most my myself no
nor not now of off on once only or other our ours out over own same she should so some such than that
the their theirs them then there these they this those through to too under until up very was we were
what when where which while who whom why will with would you your yours yourself get got getting
still even however seems seem like using use used one two also via per etc eg ie gets
try tries tried trying want wants wanted able someone anybody something anything really actually maybe
hi hello thanks thank please help anyone know issue question problem happens happened happening
traceback recent call last file line most self return raise raised module main
usr opt home local lib lib64 site packages dist conda miniconda anaconda envs env venv bin python python3
py pyc cpp cc h root workspace
""".split())


# A path keeps only its last component: install prefixes and build directories differ on every
# machine and say nothing about the problem, the file name (socket.cc, dataloader.py) does.
# (Anchored at the start of a whitespace-separated chunk so the engine tries each chunk once.)
_PATH_RE = re.compile(r"(?<!\S)[^\s/\\]*(?:[/\\][^\s/\\]*)*[/\\](?=[\w.-])")


# System paths say what the problem is (/dev/shm/nccl-*, /proc/sys/kernel/..., /sys/class/infiniband):
# their directories are kept as words.
_SYSTEM_PATH_RE = re.compile(r"(?<![\w/])/(?:dev|proc|sys|etc|run)/[^\s'\"]*")


# Consumer GPUs are named by a bare number ("multiple 4090s", "RTX 3090"); other pure numbers are dropped.
GPU_MODEL_NUMBERS = frozenset("1050 1060 1070 1080 1650 1660 2060 2070 2080 3050 3060 3070 3080 3090 "
                              "4060 4070 4080 4090 5060 5070 5080 5090".split())


def _system_path(match: re.Match) -> str:
    """/dev/shm/nccl-1 -> 'dev shm nccl-1 devshm': its words, and its first two directories as one term."""
    path = match.group(0)
    return path.replace("/", " ") + " " + "".join(path.split("/")[1:3])


def terms(text: str) -> list[str]:
    """Lowercase search terms, in text order: no numbers (but consumer GPU model numbers), hex, pids,
    directories or stopwords.

    A token of letters followed by digits (rank3, node017, eth0) also yields its letter part, so
    concrete instance numbers in a pasted log do not stop it matching an entry's generic words.
    """
    out: list[str] = []
    text = text.lower()
    if "/" in text or "\\" in text:
        text = _PATH_RE.sub(" ", _SYSTEM_PATH_RE.sub(_system_path, text))
    if not text.isascii() and _CJK_RE.search(text):
        for word, english in CHINESE_WORDS:
            if word in text:
                text = text.replace(word, f" {english} ")
        text = _CJK_RE.sub(" ", text)
    for pattern, needed, replacement in _PHRASES:
        if needed in text:
            text = pattern.sub(replacement, text)
    for token in _TOKEN_RE.findall(text):
        out.extend(_token_terms(token))
    return out


# Words people use for the same symptom. A token in a group also yields the group's word, on both
# the entry and the query side, so "the job is stuck" meets an entry written as "the job hangs" and
# "OOM" meets "out of memory". (Porter stemming already folds hangs/hanging; it does not fold
# stuck/hang, slower/slow or oom/memory.) Groups stay narrow: one symptom, no loose associations.
SYNONYMS = {
    "hang": "hang hangs hanging hung stuck freeze freezes freezing froze deadlock deadlocks deadlocked"
            " deadlocking unresponsive",
    "slow": "slow slower slowest slowly slowdown slowdowns slowness sluggish crawl crawls crawling",
    "diverge": "diverge diverges diverged diverging divergence explode explodes exploded exploding explosion"
               " blowup blew",
    "sync": "sync syncs synced syncing synchronize synchronizes synchronized synchronizing synchronization"
            " synchronous",
    "utilization": "util utilization utilizations",
    "oscillate": "oscillate oscillates oscillating oscillation fluctuate fluctuates fluctuating fluctuation"
                 " fluctuations erratic",
    "memory": "oom ooms oomed",
}
_CANONICAL = {word: canon for canon, group in SYNONYMS.items() for word in group.split() if word != canon}
# British spellings (initialise, utilisation) are folded to the American ones the other way round.
_BRITISH_RE = re.compile(r"^(initial|optim|serial|deserial|normal|util|synchron|recogn|minim|maxim|parallel"
                         r"|token|summar|organ|priorit|real|custom|visual|final|author|special|categor|quant"
                         r"|vector|random|character|standard|stabil|central|local)is(e|es|ed|ing|er|ers|ation|ations)$")
# (pattern, a word it cannot match without, replacement)
_PHRASES = [(re.compile(r"\blow[\s-]+speed\b"), "speed", "slow"),
            (re.compile(r"\bblows?[\s-]+up\b"), "blow", "diverge"),
            (re.compile(r"\bout[\s-]+of[\s-]+memory\b"), "memory", "oom")]

# Chinese words common in the issue threads of LLM training projects, and the English words the entries
# use for them: "多卡报错" (multi-GPU error) and "显存不足" (out of GPU memory) would otherwise be one unknown
# token. Longer words come first, so "显存不足" is read before "显存".
CHINESE_WORDS = (
    ("显存不足", "cuda out of memory"), ("显存溢出", "cuda out of memory"), ("内存不足", "host out of memory"),
    ("断点续训", "resume from checkpoint"), ("恢复训练", "resume training"), ("梯度检查点", "gradient checkpointing"),
    ("混合精度", "mixed precision"), ("半精度", "half precision fp16"), ("共享内存", "shared memory shm"),
    ("段错误", "segmentation fault"), ("环境变量", "environment variable"), ("数据加载", "data loading dataloader"),
    ("不收敛", "not converge"), ("利用率", "utilization"), ("找不到", "not found"),
    ("显存", "gpu memory"), ("显卡", "gpu"), ("内存", "host memory"), ("多卡", "multi gpu"),
    ("单卡", "single gpu"), ("多机", "multi node"), ("单机", "single node"), ("节点", "node"),
    ("集群", "cluster"), ("分布式", "distributed"), ("训练", "training"), ("微调", "fine tuning"),
    ("推理", "inference"), ("评估", "evaluation"), ("验证", "validation"), ("报错", "error"),
    ("错误", "error"), ("失败", "failed"), ("超时", "timeout"), ("卡住", "stuck"), ("卡死", "hang"),
    ("死锁", "deadlock"), ("很慢", "slow"), ("变慢", "slow"), ("保存", "save"), ("加载", "load"),
    ("检查点", "checkpoint"), ("梯度", "gradient"), ("损失", "loss"), ("进程", "process"),
    ("编译", "compile"), ("通信", "communication"), ("驱动", "driver"), ("版本", "version"),
    ("安装", "install"), ("容器", "container"), ("网卡", "network interface"), ("权重", "weights"),
    ("数据集", "dataset"), ("溢出", "overflow"), ("被杀", "killed"),
)
# What is left of Chinese or Japanese text says nothing to an English handbook (and would glue itself
# to the English words around it: "有些token会输出nan"): it is dropped.
_CJK_RE = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef\u3000-\u303f]+")


@functools.lru_cache(maxsize=1 << 16)
def _token_terms(token: str) -> tuple[str, ...]:
    if token in GPU_MODEL_NUMBERS:
        return (token,)
    if len(token) < 2 or token.isdigit() or token in STOPWORDS:
        return ()
    if token[0].isdigit() and sum(c.isalpha() for c in token) < 2:
        return ()
    if token.startswith("0x") or (len(token) >= 6 and _HEX_RE.fullmatch(token)):
        return ()
    british = _BRITISH_RE.match(token)
    if british:
        token = f"{british.group(1)}iz{british.group(2)}"
    canonical = _CANONICAL.get(token)
    if canonical:
        return token, canonical
    match = _LETTERS_DIGITS_RE.fullmatch(token)
    if match and match.group(1) not in STOPWORDS:
        number = token[len(match.group(1)):]
        return (token, match.group(1), number) if number in GPU_MODEL_NUMBERS else (token, match.group(1))
    return (token,)


# Words that put a query in the handbook's world: training models on GPUs and the software around it,
# other frameworks and accelerators included (the handbook answers TensorFlow, JAX, MLX, XPU, MPS ones too).
# A query with none of them (a Python TypeError, a web server's 502, chit-chat) may share words with
# an entry, but the entry is not its answer: without one, `mleng ask` is never confident on words alone.
DOMAIN_WORDS = frozenset("""
gpu gpus cuda cudnn cublas nccl rccl gloo mpi nvidia nvml nvlink nvswitch pcie infiniband ib rdma roce efa
hca mlx5 xid ecc sxm lnkcap lnksta cu nvcc nfs lustre gpfs slurmstepd docker container h100 h200 a100 b200 mi300 rocm hip amd tpu xla
torch pytorch tensor tensors autograd backward grad gradient gradients optimizer adam adamw sgd lr
scheduler loss nan inf overflow underflow fp16 bf16 fp8 fp32 tf32 amp autocast gradscaler precision
train training trainer epoch epochs step steps batch batches microbatch model models checkpoint checkpoints
weights state_dict dataloader dataset datasets sampler worker workers rank ranks distributed ddp fsdp
zero1 zero2 zero3 offload deepspeed megatron lightning accelerate transformers huggingface hf peft lora tokenizer tokenizers
collective collectives allreduce all_reduce allgather all_gather broadcast barrier reduce_scatter
torchrun elastic rendezvous c10d slurm srun sbatch salloc squeue scontrol kubernetes kubectl pod pods
compile dynamo inductor triton cudagraph cudagraphs attention flash sdpa xformers kernel kernels
memory oom allocator vram hbm shm dev inference vllm safetensors pickle mfu tflops flops throughput
dtensor aten sharding mpirun openmpi ompi jax jaxlib trl loraconfig peftmodel peftconfig
tensorflow tf keras horovod mxnet paddle paddlepaddle mlx mps xpu ipex oneapi flax optax orbax
geforce rtx gtx quadro tesla v100 a6000 a10g l40s mi250 mi250x mi210 gaudi hpu habana neuron trainium
""".split())


# Run-together identifiers of the same world: ncclRemoteError, cudaErrorIllegalAddress, torchrun.
_DOMAIN_PREFIXES = ("nccl", "cuda", "cudnn", "cublas", "torch", "triton", "nvidia", "deepspeed", "fsdp", "slurm",
                    "dynamo", "inductor", "ibv")


# Categories about one framework, and the words by which a query names it. An entry of such a category
# answers a query that names the framework, or matches one of its log signatures; a plain description
# ("training hangs after an epoch") names none and is better answered by the general entries.
FRAMEWORK_WORDS = {
    "lightning": frozenset("lightning pl lightningmodule lightningdatamodule fabric ptl".split()),
    "hf-accelerate": frozenset("transformers trainer accelerate accelerator huggingface hf peft lora trl "
                               "pretrained tokenizer seq2seqtrainer sfttrainer".split()),
    "deepspeed": frozenset("deepspeed zero1 zero2 zero3 ds_config".split()),
    "fsdp": frozenset("fsdp fsdp2 fully_shard fullyshardeddataparallel dtensor".split()),
    "compile": frozenset("compile compiled dynamo inductor triton recompile recompiles recompiling".split()),
    "kubernetes": frozenset("kubernetes k8s pod pods kubectl helm kubeflow pytorchjob".split()),
}


def domain_words(words) -> set[str]:
    return {w for w in words if w in DOMAIN_WORDS or w.startswith(_DOMAIN_PREFIXES)}


def shingles(words: list[str], size: int = 3) -> set[str]:
    return {" ".join(words[i:i + size]) for i in range(len(words) - size + 1)}


def entry_shingles(title: list[str], symptoms: list[list[str]]) -> set[str]:
    """The word 3-grams of an entry's title and symptom lines (their terms), and a two-word symptom line
    whole ("KeyError: 'step'"), which has no 3-gram: a query containing it contains the entire line."""
    found = shingles(title)
    for words in symptoms:
        found |= shingles(words) if len(words) != 2 else {" ".join(words)}
    return found


def query_shingles(words: list[str]) -> tuple[set[str], set[str]]:
    """A query's word 3-grams, and its word pairs (which meet only the two-word lines of entry_shingles)."""
    return shingles(words), shingles(words, 2)


# --- error codes -------------------------------------------------------------------------------
# Each pattern maps a concrete mention to a canonical code string; entries and queries go through
# the same extraction, so "Xid (PCI:0000:3b:00): 79" in a log meets "Xid 79" in an entry.
# (pattern, code template, words the pattern cannot match without in the lowercased text: a text with none
# of them skips the pattern, which makes reading entries faster)
_CODE_PATTERNS: list[tuple[re.Pattern, str, tuple[str, ...]]] = [
    (re.compile(r"\bxid\s*(?:\([^)]{0,40}\))?\s*[:=]?\s*(\d{1,3})\b", re.I), "xid {0}", ("xid",)),
    (re.compile(r"\bcuda(?:\s+runtime)?\s+error\s*(?:code\s*)?[:=(]?\s*(\d{1,4})\b", re.I),
     "cuda error {0}", ("cuda",)),
    (re.compile(r"\bnccl\s+error\s*(?:code\s*)?[:=(]?\s*(\d{1,3})\b", re.I), "nccl error {0}", ("nccl",)),
    (re.compile(r"\berror\s*(?:code\s*)?[:=(]?\s*(\d{1,4})\b", re.I), "error {0}", ("error",)),
    (re.compile(r"\bvendor\s+err(?:or)?\s*[:=]?\s*(\d{1,4})\b", re.I), "vendor err {0}", ("vendor",)),
    (re.compile(r"(?<!exit )\bstatus\s*[:=]?\s*(\d{1,3})\b", re.I), "status {0}", ("status",)),
    (re.compile(r"\berrno\s*[:=]?\s*(\d{1,3})\b|\[errno\s+(\d{1,3})\]", re.I), "errno {0}", ("errno",)),
    (re.compile(r"\bos\s+error\s+(\d{1,3})\b", re.I), "errno {0}", ("error",)),
    (re.compile(r"\bsig(kill|term|segv|abrt|bus|fpe|ill|int|hup|usr1|usr2|pipe|xcpu|cont|stop)\b", re.I),
     "sig{0}", ("sig",)),
    (re.compile(r"\b(?:code|status)\s*[:=]?\s*(1[2-5]\d)\b", re.I), "exit {0}", ("code", "status")),
    (re.compile(r"\bexit\s*code\s*[:=]?\s*(-?\d{1,3})\b|\bexitcode\s*[:=]?\s*(-?\d{1,3})\b", re.I),
     "exitcode {0}", ("exit",)),
    (re.compile(r"\bsignal\s*[:=]?\s*(\d{1,2})\b", re.I), "signal {0}", ("signal",)),
    (re.compile(r"\b([A-Za-z_][\w-]*\.(?:cc|cpp|cu|cuh|c|h|hpp)):(\d{1,5})\b"), "source {0}:{1}", (".c", ".h")),
    (re.compile(r"\b([A-Za-z_][\w-]*\.(?:cc|cpp|cu|cuh|c|h|hpp))\b"), "source {0}", (".c", ".h")),
]
_SIGNAL_NAMES = {s.value: s.name.lower() for s in _signal.Signals}


def _strerror_table() -> list[tuple[str, str]]:
    table = []
    for number in range(1, 134):
        try:
            message = os.strerror(number)
        except ValueError:
            continue
        if message.startswith("Unknown error") or " " not in message:
            continue
        table.append((message.lower(), f"errno {number}"))
    return table


_STRERROR = _strerror_table()
# The message text of a CUDA runtime error names it on every CUDA version, while its number changed
# (CUDA 10 renumbered: the old 77 is 700, 59 is 710). Numbers from the cudaError_t enum of the CUDA
# runtime API reference: https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html
_CUDA_MESSAGES = {
    "an illegal memory access was encountered": 700, "device-side assert triggered": 710,
    "unspecified launch failure": 719, "too many resources requested for launch": 701,
    "no kernel image is available for execution on the device": 209, "invalid device ordinal": 101,
    "no cuda-capable device is detected": 100, "system not yet initialized": 802,
    "cuda driver version is insufficient for cuda runtime version": 35,
    "all cuda-capable devices are busy or unavailable": 46, "peer access is not supported between these two devices": 217,
    "an illegal instruction was encountered": 715, "misaligned address": 716,
    "uncorrectable ecc error encountered": 214, "unknown error": 999,
}
# NCCL's ncclResult_t values and the words ncclGetErrorString gives them (nccl.h in NVIDIA/nccl).
_NCCL_RESULTS = {"unhandled cuda error": 1, "unhandled system error": 2, "internal error": 3,
                 "invalid argument": 4, "invalid usage": 5, "remote process exited or there was a network error": 6,
                 "ncclunhandledcudaerror": 1, "ncclsystemerror": 2, "ncclinternalerror": 3,
                 "ncclinvalidargument": 4, "ncclinvalidusage": 5, "ncclremoteerror": 6}
# A signal named in words after "signal" (DataLoader: "killed by signal: Killed") or standing alone
# the way the shell prints it.
_SIGNAL_WORDS = {"killed": "sigkill", "segmentation fault": "sigsegv", "aborted": "sigabrt",
                 "bus error": "sigbus", "terminated": "sigterm", "floating point exception": "sigfpe",
                 "illegal instruction": "sigill"}
_SIGNAL_WORD_RE = re.compile(r"signal[:\s]+(" + "|".join(_SIGNAL_WORDS) + r")\b"
                             r"|\b(segmentation fault|bus error|floating point exception|illegal instruction)"
                             r"|\b(aborted) \(core dumped\)", re.I)


def error_codes(text: str) -> set[str]:
    """Canonical error codes mentioned in the text: 'xid 79', 'errno 28', 'sigkill', 'source socket.cc:538'."""
    codes: set[str] = set()
    lowered = text.lower()
    for pattern, template, gates in _CODE_PATTERNS:
        if not any(gate in lowered for gate in gates):
            continue
        for match in pattern.finditer(text):
            groups = [g for g in match.groups() if g is not None]
            if not groups:
                continue
            code = template.format(*[g.lower() for g in groups])
            codes.add(code)
            # Signals reach logs as numbers in three spellings; one code for all of them.
            if template == "exitcode {0}" and groups[0].startswith("-"):
                _add_signal(codes, int(groups[0][1:]))
            elif template == "exit {0}":
                _add_signal(codes, int(groups[0]) - 128)
            elif template == "signal {0}":
                _add_signal(codes, int(groups[0]))
    for message, code in _STRERROR:
        if message in lowered:
            codes.add(code)
    for message, number in _CUDA_MESSAGES.items():
        if message in lowered:
            codes.add(f"cuda error {number}")
    if "nccl" in lowered:
        for message, number in _NCCL_RESULTS.items():
            if message in lowered:
                codes.add(f"nccl error {number}")
    for match in _SIGNAL_WORD_RE.finditer(text):
        word = next(g for g in match.groups() if g is not None).lower()
        codes.add(_SIGNAL_WORDS[word])
    return codes


def _add_signal(codes: set[str], number: int) -> None:
    name = _SIGNAL_NAMES.get(number)
    if name:
        codes.add(name)


def code_weight(code: str) -> float:
    """How much one shared code says about an entry, before dividing by how many entries share it."""
    kind = code.split(" ", 1)[0]
    if code.startswith("source ") and ":" not in code:
        return 0.4
    return {"xid": 3.0, "cuda": 2.0, "nccl": 1.5, "source": 2.5, "errno": 1.5, "vendor": 1.5,
            "error": 1.2, "status": 1.2, "signal": 0.8, "exit": 0.6, "exitcode": 0.5}.get(kind, 1.5)


# --- regex anchors -----------------------------------------------------------------------------
# Ordinary lines of healthy training logs, repeated millions of times in a big log. An anchor found
# in them would send every such line to the full regexes, so literals that occur here are the last
# choice for an anchor. (The linter's BENIGN_LINES are the stricter set no signature may match.)
ORDINARY_LOG = """
[rank0]:[I1202 13:50:14.123456 1234 train.py:412] step 1200 | loss 2.3456 | lr 3.0e-04 | grad_norm 0.987 | tokens/s 123456 | mfu 0.41
Epoch 3:  41%|####      | 2049/5000 [01:23<02:01, 24.12it/s, loss=2.31, v_num=3]
gpu-node-001:12345:12399 [3] NCCL INFO Channel 00/0 : 3 -> 4 via P2P/CUMEM/read
gpu-node-001:12345:12399 [3] NCCL INFO Connected all rings, comm 0x55d0 nRanks 16 localRanks 8
gpu-node-001:12345:12399 [3] NCCL INFO ncclCommInitRank comm 0x55d0 rank 3 nranks 16 cudaDev 3 busId 1b000 - Init COMPLETE
[default0]:[W1202 13:50:14.123 ProcessGroupNCCL.cpp:1250] Warning: TORCH_NCCL_AVOID_RECORD_STREAMS=1 has no effect
INFO: Saving checkpoint to /checkpoints/run1/step_1200.pt (took 12.3 s)
INFO: Loading dataset shard 17 of 256 from /lustre/data/tokens/part-00017.bin
eval | step 1200 | val_loss 2.401 | val_ppl 11.03 | accuracy 0.512 | time 100% done
"""
_ORDINARY = ORDINARY_LOG.lower()
# Characters from most to least frequent in lowercased log text; an anchor that starts with a rare
# one lets the regex engine skip most positions of a block with a cheap first-character test.
_COMMON_FIRST = " e0t1a2o3i4n5s6r7h8l9d.c:u/m_p-f,g=[]()|y'\"w<>b+v%k#x*j;q@z!?$&^~`{}"


def _rarity(char: str) -> int:
    index = _COMMON_FIRST.find(char)
    return index if index >= 0 else len(_COMMON_FIRST)


@functools.lru_cache(maxsize=None)
def parse_regex(pattern: str):
    """The regex's parse tree (raises re.error as re.compile would): parsed once per pattern, whether to check
    an entry's signature when it is loaded or to find its anchors when the index is built."""
    try:
        from re import _parser as sre_parse  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse  # type: ignore[no-redef]
    return sre_parse.parse(pattern)


def _parse(pattern: str):
    try:
        parsed = parse_regex(pattern)
    except re.error:
        return None
    return None if parsed.state.flags & re.VERBOSE else parsed


def _required(items) -> list[list[str]]:
    """Literal requirements of a parsed regex: each item is a list of alternatives, one of which
    every match contains ([text] for a plain literal run; several for a branch of literals)."""
    needs: list[list[str]] = []
    run: list[str] = []

    def flush() -> None:
        if run:
            needs.append(["".join(run)])
            run.clear()

    for op, value in items:
        name = str(op)
        if name == "LITERAL":
            run.append(chr(value))
            continue
        flush()
        if name == "SUBPATTERN" and value[1] == 0 and value[2] == 0:
            needs.extend(_required(value[3]))  # a group with no flag changes: required as written
        elif name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and value[0] >= 1:
            needs.extend(_required(value[2]))  # repeated at least once: its literals are required
        elif name == "BRANCH":
            alternatives = []
            for branch in value[1]:
                options = [max(alts, key=len) for alts in _required(branch) if len(alts) == 1]
                if not options:
                    alternatives = []
                    break
                alternatives.append(max(options, key=len))
            if alternatives:
                needs.append(alternatives)
    flush()
    return needs


def _trim(text: str, keep: int = 6) -> str:
    """Start the anchor at its rarest character, keeping at least `keep` characters."""
    if len(text) <= keep:
        return text
    start = max(range(len(text) - keep + 1), key=lambda i: (_rarity(text[i]), -i))
    trimmed = text[start:]
    return trimmed if trimmed not in _ORDINARY else text


def regex_anchor(pattern: str) -> list[str] | None:
    """Lowercase literals, one of which every match of the regex contains, chosen rare in ordinary logs.

    Triage scans gigabytes: a cheap search for the anchors decides which lines deserve the regexes.
    Prefer requirements absent from ordinary log lines, then longer ones; start each anchor at its
    rarest character so the scan skips quickly. None when the regex has no literal of 3+ characters.
    """
    parsed = _parse(pattern)
    if parsed is None:
        return None
    needs = [[a.lower() for a in alts] for alts in _required(parsed)]
    needs = [alts for alts in needs if all(len(a.strip()) >= 3 for a in alts)]
    if not needs:
        return None

    def score(alts: list[str]):
        ordinary = any(a in _ORDINARY for a in alts)
        return (ordinary, len(alts), -min(len(a) for a in alts))

    best = min(needs, key=score)
    return [_trim(a) for a in best]


@functools.lru_cache(maxsize=4096)
def literal_length(pattern: str) -> int:
    """How many characters of every match the regex fixes literally (its required literal text)."""
    parsed = _parse(pattern)
    if parsed is None:
        return 0
    return sum(min(len(a) for a in alts) for alts in _required(parsed))

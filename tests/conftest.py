import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

from helpers import Processes, make_tiny_llama  # noqa: E402

# Property tests check behaviour, not speed: on a loaded 2-core machine a first draw
# can take seconds, which must not fail a test. Under CI (CI=true) the draws are the
# same every run, so that a submission's result does not depend on a lucky draw; a
# developer's `make test` draws afresh (and keeps what fails in .hypothesis/), which
# is how new failures are found: each is then fixed and kept as an @example.
settings.register_profile("compushare", deadline=None, suppress_health_check=[HealthCheck.too_slow],
                          derandomize=bool(os.environ.get("CI")))
settings.load_profile("compushare")

REPO = Path(__file__).resolve().parent.parent
# The processes tests start stand for commands a user types at a terminal, where Ctrl-C
# raises KeyboardInterrupt. A suite started in the background of a shell without job
# control (as CI runners may start it) inherits SIGINT ignored, and every child would
# too (an ignored signal survives exec; a handler does not): the Ctrl-C tests would
# then test the runner's setting, not CompuShare.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Converted SmolLM2 weights are shared by every test, and with `make demo` and the
# user's own nodes: the product's cache ($COMPUSHARE_CACHE, else ~/.cache/compushare)
# holds them, converted once per machine (never the user's data dir: that is a
# temporary COMPUSHARE_HOME per test).


# References computed in this process (one-process decodes a swarm's tokens must
# equal) use the torch team the nodes compute with (NodeConfig.torch_threads, 1):
# a reduction split over another number of threads differs in its last bits, and on
# some CPUs that flips a near-tie among a quantized model's logits. One thread per
# worker also keeps 3 workers from oversubscribing 2 cores.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Tests never touch the user's data dir."""
    monkeypatch.setenv("COMPUSHARE_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def worded_model(tiny_model, tmp_path_factory):
    """The tiny model with a tokenizer: token i is the word "w<i>" (0..3: pad, bos, eos, unk). Unknown
    words (chat's "user:") must not be 0: reference_greedy's pad, which generate() would mask."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("worded") / "model"
    shutil.copytree(tiny_model, path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory) -> Path:
    """Qwen2.5's tokenizer (151,665 tokens) and chat template (tests/data/tokenizers)."""
    from helpers import unpack_qwen_tokenizer

    return unpack_qwen_tokenizer(tmp_path_factory.mktemp("qwen-tokenizer"))


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir))


@pytest.fixture(scope="session")
def tool_model(qwen_tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny Qwen2.5-shaped model that calls tools of its own accord (helpers.make_tool_model)."""
    from helpers import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tool-model") / "model", qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def other_tiny_model(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-other") / "model", seed=1)


@pytest.fixture
def processes(tmp_path):
    procs = Processes(tmp_path / "nodes")
    try:
        yield procs
    finally:
        procs.close()


ORDER = {"slow": 0, "integration": 1, "unit": 2, "gpu": 1}
GPU_TESTS = REPO / "tests" / "gpu"


def pytest_collection_modifyitems(config, items):
    """Markers follow the layout: tests/unit are fast and in-process; tests/integration
    start real hosts or processes; tests/slow use the real SmolLM2 weights. `make
    test-fast` runs `-m unit`; `make test` runs everything. The longest tests go
    first, so that the workers of `make test` do not wait on one at the end while
    the many short unit tests fill the gaps."""
    for item in items:
        kind = Path(str(item.fspath)).relative_to(REPO / "tests").parts[0]
        if kind in ORDER:
            item.add_marker(getattr(pytest.mark, kind))
    items.sort(key=lambda item: ORDER.get(Path(str(item.fspath)).relative_to(REPO / "tests").parts[0], 1))
    # tests/gpu need a CUDA device: without one they are left out here, and the summary
    # says so in one line (pytest_terminal_summary), not a skip per test.
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu and not _cuda_available():
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """One line where tests/gpu were in the run's scope but this machine has no CUDA device."""
    scope = [Path(str(arg).split("::")[0]).resolve() for arg in config.args]
    if any(path == GPU_TESTS or path in GPU_TESTS.parents for path in scope) and not _cuda_available():
        terminalreporter.write_line("tests/gpu (marked gpu) not run: torch sees no CUDA device")


@pytest.fixture(scope="module")
def smol_swarm(tmp_path_factory):
    """The real SmolLM2-135M on a local swarm of 3 node processes (10 blocks each),
    one per test module: (its home, swarm_up's description)."""
    from compushare.app.swarm import swarm_down, swarm_up

    home = tmp_path_factory.mktemp("smol-swarm")
    try:
        yield home, swarm_up(home, 3, "smollm2-135m")
    finally:
        swarm_down(home)

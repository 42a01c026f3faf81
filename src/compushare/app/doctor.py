"""`compushare doctor`'s checks, a pure core: what this machine and data dir are
(`Facts`, gathered by cli_doctor.py) in, one `Check` per question out, each with a
verdict (ok, warn, FAIL), what was found and what to do."""

from __future__ import annotations

import dataclasses

from packaging.specifiers import InvalidSpecifier, SpecifierSet

OK, WARN, FAIL = "ok", "warn", "FAIL"
MB = 10**6
DISK_HEADROOM = 2  # a conversion writes its staging copy beside the result


def _mb(count: int) -> str:
    return f"{count / MB:.0f} MB" if count >= 10 * MB else f"{count / MB:.1f} MB"


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # OK, WARN or FAIL
    message: str  # what was found
    fix: str = ""  # what to do ("" for ok)

    def line(self) -> str:
        return f"{self.verdict:<4}  {self.name}: {self.message}" + (f"; {self.fix}" if self.fix else "")


@dataclasses.dataclass(frozen=True)
class ModelNeeds:
    """What serving a model takes: from the store's manifest (`exact`), else the catalog's size."""

    name: str
    weights_bytes: int  # the whole model
    held_bytes: int = 0  # of which this data dir holds
    num_blocks: int = 0  # 0: not known yet
    block_bytes: int = 0
    exact: bool = True


@dataclasses.dataclass(frozen=True)
class Facts:
    python: tuple[int, int, int]
    python_required: str  # pyproject's requires-python, e.g. ">=3.11,<3.12"
    torch_version: str | None  # None: torch does not import
    torch_expected: str | None  # the pinned version
    cuda_device: str | None  # the CUDA device torch sees, if any
    ram_free_mb: int
    gpu_free_mb: int | None
    disk_free_mb: int  # where the data dir is (or would be)
    model: ModelNeeds | None
    model_problem: str  # why `model` is None
    data_dir: str
    data_dir_exists: bool
    data_dir_writable: bool
    token_mode: int | None  # the API token's permission bits (None: none yet)
    key_mode: int | None  # the identity key's
    node: dict | None  # node.json of the node running on the data dir
    node_status: dict | None  # its control API's /control/status (None: no answer)
    node_problem: str  # why node_status is None
    api_port: int  # configured for the next node (config.toml, else the default)
    port_taken: bool  # by another program (checked only with no node running)


def run_checks(facts: Facts) -> list[Check]:
    return [check_python(facts), check_torch(facts), check_device(facts), check_memory(facts), check_disk(facts),
            check_node(facts), check_api(facts), *check_data_dir(facts)]


def failed(checks: list[Check]) -> bool:
    return any(check.verdict == FAIL for check in checks)


def check_python(facts: Facts) -> Check:
    version = ".".join(map(str, facts.python))
    try:
        fits = SpecifierSet(facts.python_required).contains(version)
    except InvalidSpecifier:
        fits = True
    if fits:
        return Check("python", OK, f"Python {version} ({facts.python_required})")
    return Check("python", FAIL, f"Python {version}, but CompuShare needs {facts.python_required}",
                 "install a Python that fits and reinstall CompuShare with it (make install)")


def check_torch(facts: Facts) -> Check:
    pin = f"torch=={facts.torch_expected}" if facts.torch_expected else "torch"
    if facts.torch_version is None:
        return Check("torch", FAIL, "torch does not import", f"pip install {pin} (the CPU wheel, or CUDA's)")
    base = facts.torch_version.split("+")[0]
    if facts.torch_expected is None or base == facts.torch_expected:
        return Check("torch", OK, f"torch {facts.torch_version}")
    return Check("torch", WARN, f"torch {facts.torch_version}, not the {facts.torch_expected} CompuShare is "
                                "tested with", f"pip install {pin}")


def check_device(facts: Facts) -> Check:
    if facts.cuda_device is None:
        return Check("device", OK, "no CUDA device: spans compute on the CPU (slower than a GPU)")
    free = f", {facts.gpu_free_mb} MB free" if facts.gpu_free_mb is not None else ""
    return Check("device", OK, f"CUDA: {facts.cuda_device}{free}")


def check_memory(facts: Facts) -> Check:
    """Against a node's default budget: half the free RAM, or the GPU's free memory."""
    model = facts.model
    if model is None:
        return Check("memory", WARN, f"nothing to check it against: {facts.model_problem}",
                     "name a model held here or in the catalog (--model)")
    on_gpu = facts.cuda_device is not None and facts.gpu_free_mb is not None
    budget_mb = facts.gpu_free_mb if on_gpu and facts.gpu_free_mb is not None else facts.ram_free_mb // 2
    where = "GPU memory free" if on_gpu else f"half of the {facts.ram_free_mb} MB of RAM free"
    about = "" if model.exact else "about "
    need = f"{model.name} takes {about}{_mb(model.weights_bytes)}"
    if model.weights_bytes <= budget_mb * MB:
        return Check("memory", OK, f"{need}; a node has {budget_mb} MB ({where})")
    fit = budget_mb * MB // model.block_bytes if model.block_bytes else 0
    if fit >= 1:
        return Check("memory", WARN, f"{need}; a node has {budget_mb} MB ({where}): it serves at most {fit} of its "
                                     f"{model.num_blocks} blocks", "enough for a swarm; for more, free memory or "
                                                                   "serve a quantized format (NAME@q4)")
    return Check("memory", FAIL, f"{need}; a node has {budget_mb} MB ({where}): not one block fits",
                 "free memory, or serve a quantized format (NAME@q4) or a smaller model")


def check_disk(facts: Facts) -> Check:
    model = facts.model
    if model is None:
        return Check("disk", OK, f"{facts.disk_free_mb} MB free")
    missing = max(0, model.weights_bytes - model.held_bytes)
    if missing == 0:
        return Check("disk", OK, f"{model.name} is held here; {facts.disk_free_mb} MB free")
    need = f"{model.name} needs {'' if model.exact else 'about '}{_mb(missing)} more"
    if facts.disk_free_mb * MB >= DISK_HEADROOM * missing:
        return Check("disk", OK, f"{need}; {facts.disk_free_mb} MB free")
    verdict = WARN if facts.disk_free_mb * MB >= missing else FAIL
    return Check("disk", verdict, f"{need} (twice that while converting); {facts.disk_free_mb} MB free",
                 "free disk space, or set $COMPUSHARE_HOME (and $COMPUSHARE_CACHE) to a larger disk")


def check_node(facts: Facts) -> Check:
    """Reachability, as the running node's AutoNAT says."""
    if facts.node is None:
        return Check("reachability", WARN, f"no node runs on {facts.data_dir}, so nothing has been measured",
                     "start one (`compushare node -d`) and run doctor again")
    net = (facts.node_status or {}).get("net") or facts.node.get("net") or {}
    reach, relays = net.get("reachability", "unknown"), len(net.get("relays") or ())
    if reach == "public":
        return Check("reachability", OK, "publicly reachable (AutoNAT)")
    if reach == "private" and relays:
        return Check("reachability", OK, f"behind NAT, reachable through {relays} relays (hole punching upgrades "
                                         "what it can)")
    if reach == "private":
        return Check("reachability", WARN, "behind NAT and no relay held yet: peers cannot dial this node",
                     "forward a TCP port to the node's --listen address, or wait for a public peer that relays")
    return Check("reachability", WARN, "not known yet (AutoNAT asks the peers it meets)",
                 "give it a minute among peers and run doctor again")


def check_api(facts: Facts) -> Check:
    node = facts.node
    if node is not None:
        api = node.get("api")
        if not api:
            return Check("api", OK, "the node runs with its API off (--api-port -1)")
        if facts.node_status is not None:
            return Check("api", OK, f"the node's API answers at {api} (dashboard {api}/dashboard)")
        return Check("api", FAIL, f"the node's API at {api} does not answer: {facts.node_problem}",
                     "see node.log in the data dir; restart it (`compushare stop`, then `compushare node -d`)")
    if facts.api_port < 0:
        return Check("api", OK, "off in config.toml (api_port < 0)")
    if facts.api_port == 0:
        return Check("api", OK, "a node takes a free port (api_port 0)")
    if facts.port_taken:
        return Check("api", WARN, f"port {facts.api_port} is taken by another program: a node would listen on a "
                                  "free port instead", "set [node] api_port in config.toml, or --api-port")
    return Check("api", OK, f"port {facts.api_port} is free for a node's API")


def check_data_dir(facts: Facts) -> list[Check]:
    where = facts.data_dir
    if not facts.data_dir_exists:
        return [Check("data dir", OK, f"{where} does not exist yet: made on first use")]
    checks = [Check("data dir", OK, f"{where} is writable") if facts.data_dir_writable else
              Check("data dir", FAIL, f"{where} is not writable by this user", f"chown or chmod u+rwx {where}")]
    for name, mode, mask, what in (("api token", facts.token_mode, 0o077, "api.token"),
                                   ("identity key", facts.key_mode, 0o077, "identity.ed25519")):
        if mode is None:
            checks.append(Check(name, OK, f"no {what} yet: made with mode 600 on first use"))
        elif mode & mask:
            checks.append(Check(name, FAIL, f"{what} has mode {mode:o}: other users may read it",
                                f"chmod 600 {where}/{what}"))
        else:
            checks.append(Check(name, OK, f"{what} has mode {mode:o}"))
    return checks

"""A whole model's layers with every weight projection computed on CKKS ciphertexts
(model/private_layers.py, with he/ each product: encrypt the tokens' rows in the
plan chosen for their count, the provider's EncodedMatrix on a provider-side
Context, decrypt and reduce) match the plaintext layers (model/blocks.SpanRunner)
on the tiny Llama: hidden states after all 4 layers within TOLERANCE relative,
over a 7-token prefill (prompt plans: 3 tokens a ciphertext, the last group
partial) and 3 greedy decode steps (decode plans), and the same greedy tokens.

Why 2e-3 and not tighter: CKKS's error here is absolute, about 1e-6 to 4e-5 per
product whatever the values (a giant-step rotation after the rescale adds its
key-switching noise at scale 2^36; the size depends on the key set). The tiny
random model's activations are small (the down projection's input is ~0.008, its
product ~0.002), so that floor is 1e-4 to 5e-4 of a product, and the hidden states
after 4 layers measured 1.1e-4 to 7.9e-4 relative over 48 key sets. SmolLM2's real
activations are 10 to 1000 times larger (its products measured 1e-8 to 7e-6
relative). The logits' top-2 gaps (>= 0.04) dwarf their error (~7e-5), so the
tokens are equal with a wide margin. The control test below shows the layers
themselves add nothing (exact products: < 1e-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compushare.he.ckks import Context, SecretContext
from compushare.he.groups import GROUPS, group_shapes, group_weight, required_steps
from compushare.he.matvec import EncodedMatrix
from compushare.he.plan import choose, plans
from compushare.model.arch import load_config
from compushare.model.blocks import SpanRunner
from compushare.model.head import ConsumerHead
from compushare.model.private_layers import PrivateLayers
from compushare.model.weights import read_tensors

pytestmark = pytest.mark.unit

PROMPT = [1, 9, 8, 7, 6, 5, 4]
DECODE_STEPS = 3
TOLERANCE = 1e-4


class EncryptedProjections:
    """The `project` callback of PrivateLayers, done as private mode does it."""

    def __init__(self, model_dir) -> None:
        self.config = load_config(model_dir)
        self.secret = SecretContext()
        self.provider = Context()
        steps = required_steps(self.config, self.secret.slots)
        self.keys = self.provider.galois_keys_from(self.secret.galois_keys(steps), steps)
        state = read_tensors(model_dir, lambda names: [n for n in names if n.endswith("_proj.weight")])
        state = {k: v.float().numpy() for k, v in state.items()}
        # A provider pre-encodes each product in every plan its requests may use.
        self.matrices = {}
        for layer in range(self.config.num_hidden_layers):
            for group in GROUPS:
                weight = group_weight(state, layer, group)
                for plan in plans(*weight.shape, self.provider.slots):
                    self.matrices[(layer, group, plan)] = EncodedMatrix(self.provider, weight, plan)
        self.calls: list[tuple[int, str, int, object]] = []  # layer, group, tokens, plan

    def __call__(self, layer: int, group: str, x: torch.Tensor) -> torch.Tensor:
        inputs = x.double().numpy()
        tokens = len(inputs)
        plan = choose(*group_shapes(self.config)[group], self.secret.slots, tokens)  # both sides: shape, count
        matrix = self.matrices[(layer, group, plan)]
        assert x.shape[-1] == plan.cols
        self.calls.append((layer, group, tokens, plan))
        decrypted = []
        for start in range(0, tokens, plan.tokens):
            wire = [self.secret.encrypt(s) for s in plan.input_slots(inputs[start:start + plan.tokens])]  # consumer
            outs = matrix.apply(self.provider, self.keys, [self.provider.ciphertext_from(ct) for ct in wire])
            back = [self.provider.dump(outs[o]) for o in range(plan.outputs)]  # provider
            decrypted += [self.secret.decrypt(ct) for ct in back]  # consumer
        return torch.from_numpy(plan.reduce(np.stack(decrypted), tokens)).to(x.dtype)


def plaintext_projections(model_dir):
    config = load_config(model_dir)
    state = read_tensors(model_dir, lambda names: [n for n in names if n.endswith("_proj.weight")])
    weights = {(layer, group): torch.from_numpy(group_weight(state, layer, group))
               for layer in range(config.num_hidden_layers) for group in GROUPS}
    return lambda layer, group, x: (x.double() @ weights[(layer, group)].T).to(x.dtype)


def generate(model_dir, forward, new_cache):
    """Greedy prefill + decode steps; the hidden states after the last layer and the
    token chosen at each step."""
    head = ConsumerHead.load(model_dir)
    cache = new_cache()
    tokens, hiddens, position = list(PROMPT), [], 0
    step_tokens = list(PROMPT)
    for _ in range(1 + DECODE_STEPS):
        hidden = forward(head.embed_tokens(step_tokens), cache, position)
        hiddens.append(hidden)
        position += len(step_tokens)
        step_tokens = [int(torch.argmax(head.logits(hidden)))]
        tokens += step_tokens
    return hiddens, tokens[len(PROMPT):]


@pytest.fixture(scope="module")
def plaintext_run(tiny_model):
    runner = SpanRunner.load(tiny_model, 0, 4)
    return generate(tiny_model, runner.forward, runner.new_cache)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm((a - b).double()) / torch.linalg.norm(b.double()))


def test_encrypted_layers_match_plaintext_layers(tiny_model, plaintext_run):
    project = EncryptedProjections(tiny_model)
    layers = PrivateLayers.load(tiny_model, project)
    hiddens, tokens = generate(tiny_model, layers.forward, layers.new_cache)
    expected_hiddens, expected_tokens = plaintext_run
    assert [h.shape for h in hiddens] == [(1, len(PROMPT), 64)] + [(1, 1, 64)] * DECODE_STEPS
    errors = [relative(h, e) for h, e in zip(hiddens, expected_hiddens)]
    assert max(errors) <= TOLERANCE, errors
    assert tokens == expected_tokens
    # Every layer's four products, once per step (not per projection): q, k and v
    # come from one product, gate and up from another.
    steps = 1 + DECODE_STEPS
    assert layers.products == 4 * 4 * steps
    assert sorted({(layer, group) for layer, group, _, _ in project.calls}) == sorted(
        (layer, group) for layer in range(4) for group in GROUPS)
    assert [n for layer, group, n, _ in project.calls if (layer, group) == (0, "qkv")] == [len(PROMPT)] + [1] * 3
    # The prefill's products in prompt plans, with a partial last group; the decode steps' in decode plans.
    assert all(1 < plan.tokens < n and n % plan.tokens for _, _, n, plan in project.calls if n > 1)
    assert all(plan.tokens == 1 for _, _, n, plan in project.calls if n == 1)


def test_private_layers_with_exact_products_equal_the_plaintext_layers(tiny_model, plaintext_run):
    """The control: the same layers with products computed in plaintext (float64)
    agree with SpanRunner to float32 rounding, so the 1e-4 above is CKKS's alone."""
    layers = PrivateLayers.load(tiny_model, plaintext_projections(tiny_model))
    hiddens, tokens = generate(tiny_model, layers.forward, layers.new_cache)
    expected_hiddens, expected_tokens = plaintext_run
    assert max(relative(h, e) for h, e in zip(hiddens, expected_hiddens)) < 1e-5
    assert tokens == expected_tokens


def test_private_layers_hold_no_projection_weight(tiny_model):
    """The consumer reads norms (and biases) only: the products' weights stay with the providers."""
    layers = PrivateLayers.load(tiny_model, plaintext_projections(tiny_model))
    names = [name for layer in layers.layers for name, _ in layer.named_parameters()]
    names += [name for layer in layers.layers for name, _ in layer.named_buffers()]
    assert names and not [n for n in names if "_proj" in n]

"""The shared blocks (models/blocks.py) against transformers' own modules on the same weights (fp32 within
1e-6 unless stated): each activation against ACT2FN, the gated MLP against LlamaMLP, the plain one against
NemotronMLP, the (1 + weight) RMSNorm against Gemma3RMSNorm, sandwich norms in a whole decoder layer against
Gemma3DecoderLayer, post norms against Olmo3DecoderLayer (its attention, whose q/k norms span the whole
projection, swapped for ours: the norms' placement and order are what is compared). Then a toy family defined
only here (a plain GELU MLP with biases, sandwich (1 + weight) norms, scaled embeddings, its own init),
registered for this file's tests alone, trains in dp2 and tp2 with sp equal to one process; and today's
families start from the same bits as the suffix rules they had before the family init."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import transformers
from torch import nn
from transformers.activations import ACT2FN

from tetron.config import ConfigError, from_dict
from tetron.models import FAMILIES, family
from tetron.models.blocks import ACTIVATIONS, MLP, RMSNorm, layer_norm_names, standard_init
from tetron.models.llama import LLAMA, DecoderLayer, Llama, LlamaConfig, rope_cos_sin
from tetron.models.spec import Block, Init, ModelSpec, ParallelPlan, register
from tetron.parallel.init import init_rules, name_seed, seeded_model

from conftest import check_layout, tiny_config

ATOL = 1e-6
H, INTER, B, T = 32, 64, 2, 12


def _x(*shape: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_transformers(name):
    x = _x(4096)
    torch.testing.assert_close(ACTIVATIONS[name](x), ACT2FN[name](x), atol=ATOL, rtol=0)


@dataclass
class _SiluOnlyConfig(LlamaConfig):
    """A family whose transformers class takes one activation only."""

    hf_architecture: ClassVar[str] = "SiluOnlyForCausalLM"
    mlp_activations: ClassVar[tuple[str, ...]] = ("silu",)


def test_unsupported_activation_is_one_line():
    with pytest.raises(ValueError, match=r"^hidden_act='xielu' is not supported; use one of silu, swish, gelu"):
        LlamaConfig(hidden_act="xielu")
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported by tetron's SiluOnlyForCausalLM"):
        _SiluOnlyConfig(hidden_act="gelu")
    with pytest.raises(ValueError, match="mlp_bias=True: Qwen2ForCausalLM's MLP has no biases"):
        family("qwen2").config_class(mlp_bias=True)


def test_unsupported_activation_in_a_run_config(corpus, cache_dir, tmp_path):
    with pytest.raises(ConfigError, match="hidden_act='xielu'"):
        from_dict(tiny_config(corpus, cache_dir, tmp_path, model={"hidden_act": "xielu"}))


def _copy(ours: nn.Module, theirs: nn.Module) -> None:
    """theirs' tensors, randomised to O(1) effect, into ours by name."""
    torch.manual_seed(1)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
    ours.load_state_dict(theirs.state_dict(), strict=True)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "gelu", "relu"])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_matches_llama_mlp(act, bias):
    from transformers.models.llama.modeling_llama import LlamaMLP

    theirs = LlamaMLP(transformers.LlamaConfig(hidden_size=H, intermediate_size=INTER, hidden_act=act, mlp_bias=bias))
    ours = MLP(H, INTER, act=act, gated=True, bias=bias)
    _copy(ours, theirs)
    x = _x(B, T, H)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=ATOL, rtol=0)


@pytest.mark.parametrize("act", ["relu2", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("bias", [False, True])
def test_plain_mlp_matches_nemotron_mlp(act, bias):
    from transformers.models.nemotron.modeling_nemotron import NemotronMLP

    theirs = NemotronMLP(transformers.NemotronConfig(hidden_size=H, intermediate_size=INTER, hidden_act=act,
                                                     mlp_bias=bias))
    ours = MLP(H, INTER, act=act, gated=False, bias=bias)
    _copy(ours, theirs)
    assert not hasattr(ours, "gate_proj")
    x = _x(B, T, H)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), atol=ATOL, rtol=0)


def test_mlp_limit_clamps_as_gpt_oss():
    """gpt-oss clamps the gate from above and up on both sides at `limit` before the activation (its own
    activation, alpha and up + 1, is its family's); hand-written reference, and the clamp changes the output."""
    limit = 0.5
    ours = MLP(H, INTER, act="silu", gated=True, limit=limit)
    x = _x(B, T, H, scale=1.0)
    with torch.no_grad():
        gate, up = ours.gate_proj(x), ours.up_proj(x)
        assert (gate > limit).any() and (up.abs() > limit).any()
        expected = ours.down_proj(torch.nn.functional.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit))
        unclamped = ours.down_proj(torch.nn.functional.silu(gate) * up)
        torch.testing.assert_close(ours(x), expected, atol=ATOL, rtol=0)
        assert (ours(x) - unclamped).abs().max() > 1e-3
    with pytest.raises(ValueError, match="limit"):
        MLP(H, INTER, gated=False, limit=limit)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_offset_norm_matches_gemma3(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    theirs, ours = Gemma3RMSNorm(H, eps=1e-6), RMSNorm(H, 1e-6, unit_offset=True)
    assert torch.equal(ours.weight, theirs.weight)  # both start at zero: the identity
    with torch.no_grad():
        theirs.weight.normal_(0.0, 0.5)
        ours.weight.copy_(theirs.weight)
    theirs.to(dtype), ours.to(dtype)
    x = _x(B, T, H).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))  # the same fp32 arithmetic and cast, bit for bit


# ----------------------------------------------------------------------------- a family made of the options


@dataclass
class SandwichConfig(LlamaConfig):
    """A toy Gemma-like family: a plain GELU MLP, sandwich (1 + weight) norms, scaled embeddings."""

    model_type: str = "toy_sandwich"
    hidden_act: str = "gelu_pytorch_tanh"
    mlp_bias: bool = True

    hf_architecture: ClassVar[str] = "ToySandwichForCausalLM"
    mlp_gated: ClassVar[bool] = False
    norm_placement: ClassVar[str] = "sandwich"
    norm_unit_offset: ClassVar[bool] = True
    scale_embeddings: ClassVar[bool] = True


def sandwich_init(module: nn.Module, name: str, config: Any) -> Init:
    """The standard init, but the linears that write into the residual stream scaled by 1/sqrt(2 layers)
    (GPT-2's): a family's own rule by module role."""
    init = standard_init(module, name, config)
    if init.kind == "normal" and getattr(module, "_residual_out", False):
        return Init("normal", init.std / (2 * config.num_hidden_layers) ** 0.5)
    return init


class SandwichLM(Llama):
    """Llama's model class, composed from the options; marks its residual-writing linears for its init."""

    def __init__(self, config: SandwichConfig) -> None:
        super().__init__(config)
        for layer in self.model.layers.values():
            layer.self_attn.o_proj._residual_out = layer.mlp.down_proj._residual_out = True


SANDWICH = ModelSpec(
    name="toy_sandwich", model_types=("toy_sandwich",), config_class=SandwichConfig, model_class=SandwichLM,
    plan=ParallelPlan(blocks=(LLAMA.plan.blocks[0], Block("mlp", column=("up_proj",), row="down_proj")),
                      residual_norms=layer_norm_names("sandwich")),
    init=sandwich_init)


@pytest.fixture
def sandwich_family():
    """The toy family, known for one test (forked ranks inherit the registry), and forgotten after it."""
    assert "toy_sandwich" not in FAMILIES
    register(SANDWICH)
    yield SANDWICH
    del FAMILIES["toy_sandwich"]


TOY = dict(vocab_size=64, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _causal(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T], additive


def test_sandwich_layer_matches_gemma3_decoder_layer():
    """Our decoder layer with sandwich (1 + weight) norms and a gated GeGLU against Gemma3DecoderLayer with
    its own attention (q/k norms per head, of the family's (1 + weight) kind as theirs)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer

    @dataclass
    class GemmaLike(SandwichConfig):
        mlp_bias: bool = False
        mlp_gated: ClassVar[bool] = True
        qk_norm: ClassVar[bool] = True

    cfg = GemmaLike(**TOY)
    hf_cfg = transformers.Gemma3TextConfig(
        hidden_size=H, intermediate_size=INTER, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=8, rms_norm_eps=cfg.rms_norm_eps,
        layer_types=["full_attention"], num_hidden_layers=1, vocab_size=64)
    hf_cfg._attn_implementation = "eager"
    theirs, ours = Gemma3DecoderLayer(hf_cfg, 0).eval(), DecoderLayer(cfg, 0).eval()
    torch.manual_seed(2)
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.3)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = _x(B, T, H, scale=1.0)
    cos, sin = rope_cos_sin(cfg, torch.arange(T)[None], dtype=torch.float32)
    with torch.no_grad():
        expected = theirs(x, position_embeddings=(cos, sin), attention_mask=_causal(T))
        assert expected.abs().max() > 1.0
        # a whole layer: its attention kernels differ (transformers' eager matmul and softmax, our SDPA), so
        # the tolerance of test_families' whole-model comparisons
        torch.testing.assert_close(ours(x, cos, sin), expected, atol=1e-5, rtol=0)


def test_post_norm_layer_matches_olmo3_decoder_layer():
    """Post norms (OLMo's: on each block's output, before the residual add) against Olmo3DecoderLayer, whose
    attention is swapped for ours (its q/k norms over the whole projection are attention's to offer)."""
    from transformers.models.olmo3.modeling_olmo3 import Olmo3DecoderLayer

    @dataclass
    class OlmoLike(LlamaConfig):
        norm_placement: ClassVar[str] = "post"

    cfg = OlmoLike(**TOY)
    hf_cfg = transformers.Olmo3Config(hidden_size=H, intermediate_size=INTER, num_attention_heads=4,
                                      num_key_value_heads=2, num_hidden_layers=1, vocab_size=64,
                                      rms_norm_eps=cfg.rms_norm_eps)
    ours = DecoderLayer(cfg, 0).eval()
    theirs = Olmo3DecoderLayer(hf_cfg, 0).eval()

    class Adapter(nn.Module):  # transformers' attention call, answered by our attention
        def forward(self, hidden_states, position_embeddings, **kwargs):
            return ours.self_attn(hidden_states, *position_embeddings), None

    theirs.self_attn = Adapter()
    torch.manual_seed(3)
    with torch.no_grad():
        for p in [*ours.self_attn.parameters(), *theirs.parameters()]:
            p.normal_(0.0, 0.3)
    ours.load_state_dict({**ours.state_dict(), **theirs.state_dict()}, strict=True)
    assert [n for n, _ in ours.named_children()] == ["self_attn", "mlp", "post_attention_layernorm",
                                                     "post_feedforward_layernorm"]
    x = _x(B, T, H, scale=1.0)
    cos, sin = rope_cos_sin(cfg, torch.arange(T)[None], dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, cos, sin), theirs(x, position_embeddings=(cos, sin)), atol=ATOL, rtol=0)


def test_embedding_scale_in_the_embedding_dtype(sandwich_family):
    """The first layer sees the embedding times sqrt(hidden) rounded to the embedding's dtype (Gemma's)."""
    model = Llama(SandwichConfig(**TOY)).to(torch.bfloat16)
    seen = []
    model.model.layers["0"].register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids)
        scale, embedded = torch.tensor(H ** 0.5).to(torch.bfloat16), model.model.embed_tokens(ids)
        assert torch.equal(seen[0], embedded * scale)
        assert not torch.equal(seen[0], embedded * H ** 0.5)  # unrounded, the scale would give other bits


def test_family_init_and_param_count(sandwich_family):
    """The toy's own init: its (1 + weight) norms start at zero, biases at zero, its residual-writing linears
    at the scaled std; and num_params counts what the module holds."""
    cfg = SandwichConfig(**{**TOY, "intermediate_size": 256, "hidden_size": 128, "head_dim": 32})
    model = seeded_model(cfg, seed=0, device=torch.device("cpu"))
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    layer = model.model.layers["1"]
    for name in layer_norm_names("sandwich"):
        assert torch.equal(getattr(layer, name).weight, torch.zeros(128)), name
    assert not layer.mlp.up_proj.bias.any() and not layer.mlp.down_proj.bias.any()
    assert float(layer.mlp.up_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
    assert float(layer.mlp.down_proj.weight.detach().std()) == pytest.approx(0.01, rel=0.05)  # 0.02 / sqrt(2 * 2)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_families_start_as_with_suffix_rules(model_type):
    """The init before families chose their own: ones for `*norm.weight`, zeros for `*.bias`, else N(0,
    initializer_range) from the name's seed; the family init gives the same bits."""
    cfg = family(model_type).config_class(**{**TOY, "num_experts": 4, "num_experts_per_tok": 2,
                                             "moe_intermediate_size": 16} if model_type == "qwen3_moe" else TOY)
    model = seeded_model(cfg, seed=7, device=torch.device("cpu"))
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            expected = torch.ones(p.shape)
        elif name.endswith(".bias"):
            expected = torch.zeros(p.shape)
        else:
            g = torch.Generator().manual_seed(name_seed(7, name))
            expected = torch.empty(p.shape).normal_(0.0, cfg.initializer_range, generator=g)
        assert torch.equal(p, expected), name
    assert set(init_rules(model)) >= {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("parallel", [{"dp": 2}, {"tp": 2, "sp": True}, {"pp": 2}], ids=["dp2", "tp2-sp", "pp2"])
def test_sandwich_family_layouts_match_single_process(sandwich_family, corpus, cache_dir, tmp_path, parallel):
    """A family defined only in this file trains in dp2, tp2 with sp and pp2 equal to one process (losses 1e-5
    relative, weights 1e-5): its plain MLP splits as its plan says, its four norms per layer summed over tp, its
    embedding scaled on the first stage only."""
    # Seed 2, not conftest's 1: at seed 1 one embedding element's step-2 gradient is 5e-9 in one process and
    # -2e-8 under tp2 sp (rounding, 1e-6 of its row's largest), and AdamW turns either sign into a whole step of
    # lr (measured; conftest's LAYOUT_LR note): the final weights then differ there by 3e-4, the losses by 1e-7.
    _, written = check_layout(corpus, cache_dir, tmp_path, model={"model_type": "toy_sandwich"},
                              parallel={**parallel, "bucket_mb": 0.01}, train={"seed": 2})
    for key, value in written["model"].items():  # every kind of tensor trained: norms left 0, biases left 0
        if key.endswith(("norm.weight", ".bias")):
            assert value.abs().max() > 1e-4, key


def test_llama_with_gelu_and_mlp_bias_matches_transformers():
    """A Llama config.json with another activation and MLP biases is read, and its logits equal
    LlamaForCausalLM's on the same weights (fp32, 1e-5)."""
    cfg = LlamaConfig(**{**TOY, "hidden_act": "gelu_pytorch_tanh", "mlp_bias": True})
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
    assert hf_cfg.hidden_act == "gelu_pytorch_tanh" and hf_cfg.mlp_bias
    assert LlamaConfig.from_hf(cfg.to_hf()) == cfg
    torch.manual_seed(5)
    theirs = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
    ours = Llama(cfg).eval()
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, atol=1e-5, rtol=1e-5)


def test_plan_of_the_toy_splits_its_plain_mlp(sandwich_family):
    """The plain MLP's up_proj is column-parallel (weight and bias), down_proj row-parallel (its bias whole)."""
    plan = SANDWICH.plan
    assert plan.tp_dim("mlp.up_proj.weight") == 0 and plan.tp_dim("mlp.up_proj.bias") == 0
    assert plan.tp_dim("mlp.down_proj.weight") == 1 and plan.tp_dim("mlp.down_proj.bias") is None
    names = {n for n, _ in Llama(SandwichConfig(**TOY)).model.layers["0"].named_parameters()}
    assert {f"{n}.weight" for n in plan.residual_norms} <= names

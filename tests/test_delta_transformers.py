"""attnx.torch.register_delta_rule(): Hugging Face hybrid models built from
tiny random configs (no download) give the logits, parameter gradients and
generations of transformers' torch fallback, with that fallback trapped
while attnx runs: Qwen3-Next, Qwen3.5 (dense and MoE), OLMo hybrid (the
gated delta rule) and Kimi Linear (Kimi Delta Attention). float32 only:
the fallbacks compute in float32 whatever their inputs' dtype (so float64
models could agree no better than float32 ones), and the MoE layers' grouped
GEMM takes no float64. attnx's float64 accuracy is tested against float64
references in tests/test_delta.py and tests/test_delta_torch.py."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import attnx.torch as at  # noqa: E402
from attnx.torch import _delta as _torch_delta  # noqa: E402


def qwen3_next_config():
    return transformers.Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16)


def kimi_linear_config():
    return transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=16, kv_lora_rank=16, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        linear_attn_config={"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2,
                            "head_dim": 8, "short_conv_kernel_size": 4})


GATED = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"])


def qwen3_5_config():
    return transformers.Qwen3_5TextConfig(head_dim=16, **GATED)


def qwen3_5_moe_config():
    return transformers.Qwen3_5MoeTextConfig(
        head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, **GATED)


def olmo_hybrid_config():
    return transformers.OlmoHybridConfig(pad_token_id=0, eos_token_id=1, **GATED)


def trapped(*args, **kwargs):
    raise AssertionError("transformers' torch fallback ran while attnx was registered")


CONFIGS = [qwen3_next_config, qwen3_5_config, qwen3_5_moe_config, olmo_hybrid_config,
           kimi_linear_config]


@pytest.mark.parametrize("make_config", CONFIGS, ids=[make.__name__[:-7] for make in CONFIGS])
def test_model_through_attnx_equals_fallback(make_config, monkeypatch):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(make_config())
    ids = torch.randint(3, 64, (2, 13))

    def run():
        model.zero_grad()
        logits = model(ids).logits
        (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        generated = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False)
        return logits.detach(), grads, generated

    ref_logits, ref_grads, ref_generated = run()
    # the fallbacks replaced by traps, which register_delta_rule then replaces
    module = type(model.model.layers[0]).__module__
    import sys
    for name in _torch_delta._HF_FUNCTIONS:
        if hasattr(sys.modules[module], name):
            monkeypatch.setattr(sys.modules[module], name, trapped)
    assert module in at.register_delta_rule()
    try:
        logits, grads, generated = run()
    finally:
        at.unregister_delta_rule()
    assert all(getattr(sys.modules[module], name) is trapped
               for name in _torch_delta._HF_FUNCTIONS if hasattr(sys.modules[module], name))
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4 * ref_logits.abs().max())
    assert grads.keys() == ref_grads.keys()
    # a float32 gradient that is a sum over tokens cancelling to far less
    # than its terms (a linear layer's dt_bias: 2e-6 where its layer's
    # other gradients are 1e-1) keeps the rounding of those terms: the
    # absolute tolerance is measured against the model's largest gradient
    largest = max(grad.abs().max() for grad in ref_grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-4 * largest,
                                   msg=lambda text: f"{name}: {text}")
    assert torch.equal(generated, ref_generated)

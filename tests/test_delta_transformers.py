"""attnx.torch.register_delta_rule(): Hugging Face hybrid models built from
tiny random configs (no download) give the logits, parameter gradients and
generations of transformers' torch fallback, with that fallback trapped
while attnx runs. float32: these models' MoE layers take no float64."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import attnx.torch as at  # noqa: E402
from attnx import _torch_delta  # noqa: E402


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


def trapped(*args, **kwargs):
    raise AssertionError("transformers' torch fallback ran while attnx was registered")


@pytest.mark.parametrize("make_config", [qwen3_next_config, kimi_linear_config])
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
    for name, grad in grads.items():
        scale = ref_grads[name].abs().max()
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-4 * scale + 1e-12)
    assert torch.equal(generated, ref_generated)

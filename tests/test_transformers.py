"""attn_implementation="attnx" in Hugging Face transformers: tiny randomly
initialised models (no downloads) give the outputs and parameter gradients
of "sdpa", without calling torch's SDPA, with padding reaching attnx as
key padding and causality as the causal flag."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import attnx  # noqa: E402
import attnx.torch as at  # noqa: E402
from attnx.torch._transformers import _transformers_mask  # noqa: E402

at.register_transformers()

TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention
TOL = dict(rtol=1e-10, atol=1e-12)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Records the mask shape and causal option of every attnx softmax
    call, and makes torch's SDPA raise."""
    calls = []
    real = attnx.softmax_attention

    def spy(q, k, v, **kwargs):
        mask = kwargs.get("mask")
        calls.append((None if mask is None else mask.shape, kwargs.get("causal"),
                      None if kwargs.get("bias") is None else kwargs["bias"].shape))
        return real(q, k, v, **kwargs)

    def forbidden(*args, **kwargs):
        raise AssertionError("torch's scaled_dot_product_attention was called")

    monkeypatch.setattr(attnx, "softmax_attention", spy)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", forbidden)
    return calls


def pair(model_class, config, tmp_path):
    """The same random weights under "sdpa" and, through from_pretrained,
    under "attnx"."""
    torch.manual_seed(0)
    reference = model_class._from_config(config, attn_implementation="sdpa").double()
    reference.save_pretrained(tmp_path)
    ours = model_class.from_pretrained(tmp_path, attn_implementation="attnx",
                                       dtype=torch.float64)
    assert ours.config._attn_implementation == "attnx"
    return ours, reference


def llama_config(positions=64):
    return transformers.LlamaConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=positions)


def half_llamas(positions=64, dtype=torch.bfloat16):
    """The same random Llama in half-precision `dtype` under "attnx" and
    under "sdpa" (each its own config: the implementation is the
    config's)."""
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM._from_config(llama_config(positions),
                                                           attn_implementation="sdpa")
    reference = reference.to(dtype)
    ours = transformers.LlamaForCausalLM._from_config(llama_config(positions),
                                                      attn_implementation="attnx")
    ours = ours.to(dtype)
    ours.load_state_dict(reference.state_dict())
    return ours, reference


def bert_config():
    return transformers.BertConfig(
        vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)


def left_padded_batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 97, (3, 11), generator=g)
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :1] = 0
    return ids, mask


def parameter_grads(model, loss):
    model.zero_grad()
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_decoder_inference_and_training_match_sdpa(tmp_path, kernel_calls):
    ids, mask = left_padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    ours, reference = pair(transformers.LlamaForCausalLM, llama_config(), tmp_path)
    ours.train()
    reference.train()
    out = ours(ids, attention_mask=mask, labels=labels)
    our_grads = parameter_grads(ours, out.loss)
    assert kernel_calls, "attnx was not called"
    # padding as a causal key padding: (B, kv heads, 1, 1, m) for grouped heads, lower-right causal
    assert {c[:2] for c in kernel_calls} == {((3, 1, 1, 1, 11), "lower_right")}
    calls = len(kernel_calls)
    ref = _without_spy(lambda: reference(ids, attention_mask=mask, labels=labels))
    ref_grads = parameter_grads(reference, ref.loss)
    assert len(kernel_calls) == calls
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    torch.testing.assert_close(out.loss, ref.loss, **TOL)
    assert our_grads.keys() == ref_grads.keys() and len(our_grads) > 10
    for name in our_grads:
        torch.testing.assert_close(our_grads[name], ref_grads[name], **TOL, msg=name)


def _without_spy(fn):
    """Run the reference with torch's real SDPA (the fixture replaced it)."""
    functional = torch.nn.functional
    saved = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = TORCH_SDPA
    try:
        return fn()
    finally:
        functional.scaled_dot_product_attention = saved


def test_decoder_without_padding_uses_the_causal_flag(tmp_path, kernel_calls):
    ids, _ = left_padded_batch()
    ours, reference = pair(transformers.LlamaForCausalLM, llama_config(), tmp_path)
    logits = ours(ids).logits
    assert {c for c in kernel_calls} == {(None, "upper_left", None)}
    torch.testing.assert_close(logits, _without_spy(lambda: reference(ids).logits), **TOL)


def test_decoder_generation_with_kv_cache_matches_sdpa(tmp_path, kernel_calls):
    ids, mask = left_padded_batch()
    ours, reference = pair(transformers.LlamaForCausalLM, llama_config(), tmp_path)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        got = ours.generate(ids, **kwargs)
        want = _without_spy(lambda: reference.generate(ids, **kwargs))
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, **TOL)
    # decoding steps: one query against the cache, padding as key padding
    steps = [c for c in kernel_calls if c[0] is not None and c[0][-1] > ids.shape[1]]
    assert steps and all(shape[-2] == 1 for shape, _, _ in steps)


def test_encoder_padding_matches_sdpa(tmp_path, kernel_calls):
    ids, mask = left_padded_batch()
    mask = mask.flip(-1)  # right padding, as BERT tokenizers give
    ours, reference = pair(transformers.BertModel, bert_config(), tmp_path)
    ours.train()
    reference.train()
    out = ours(ids, attention_mask=mask)
    loss = (out.last_hidden_state * mask[..., None]).pow(2).sum() + out.pooler_output.sum()
    our_grads = parameter_grads(ours, loss)
    # padding expanded along the queries reaches attnx as key padding, not causal
    assert {c[:2] for c in kernel_calls} == {((3, 1, 1, 11), False)}
    ref = _without_spy(lambda: reference(ids, attention_mask=mask))
    ref_loss = (ref.last_hidden_state * mask[..., None]).pow(2).sum() + ref.pooler_output.sum()
    ref_grads = parameter_grads(reference, ref_loss)
    valid = mask.bool()
    torch.testing.assert_close(out.last_hidden_state[valid], ref.last_hidden_state[valid], **TOL)
    torch.testing.assert_close(out.pooler_output, ref.pooler_output, **TOL)
    for name in our_grads:
        torch.testing.assert_close(our_grads[name], ref_grads[name], **TOL, msg=name)


def test_encoder_without_padding_and_float32(tmp_path, kernel_calls):
    ids, _ = left_padded_batch()
    config = bert_config()
    torch.manual_seed(0)
    reference = transformers.AutoModel.from_config(config, attn_implementation="sdpa").eval()
    ours = transformers.AutoModel.from_config(config, attn_implementation="attnx").eval()
    assert isinstance(ours, transformers.BertModel)
    ours.load_state_dict(reference.state_dict())
    got = ours(ids).last_hidden_state
    assert {c for c in kernel_calls} == {(None, False, None)}
    want = _without_spy(lambda: reference(ids).last_hidden_state)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_other_patterns_fall_back_to_a_full_mask(tmp_path):
    """Packed sequences (positions restarting) need a query-dependent mask:
    transformers' own mask builder makes it, attnx reads it whole."""
    from transformers import masking_utils

    padding = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    full = _transformers_mask(2, 5, 5, mask_function=masking_utils.sliding_window_causal_mask_function(2),
                                 attention_mask=padding, local_size=2)
    want = masking_utils.sdpa_mask(2, 5, 5, mask_function=masking_utils.sliding_window_causal_mask_function(2),
                                   attention_mask=padding, allow_is_causal_skip=False)
    assert torch.equal(full, want)
    causal = _transformers_mask(2, 5, 5, mask_function=masking_utils.causal_mask_function,
                                   attention_mask=padding)
    assert causal.shape == (2, 1, 1, 5) and torch.equal(causal[:, 0, 0], padding)
    bidirectional = _transformers_mask(2, 5, 5, mask_function=masking_utils.bidirectional_mask_function,
                                          attention_mask=padding)
    assert bidirectional.shape == (2, 1, 5, 5) and bidirectional.stride(-2) == 0


def test_decoder_in_bfloat16_trains(kernel_calls):
    """bfloat16 weights end to end: outputs and gradients in bfloat16, within
    bfloat16 rounding of the same model run through torch's SDPA."""
    ids, mask = left_padded_batch()
    labels = ids.masked_fill(mask == 0, -100)
    ours, reference = half_llamas()
    out = ours(ids, attention_mask=mask, labels=labels)
    assert out.logits.dtype == torch.bfloat16
    grads = parameter_grads(ours, out.loss)
    assert kernel_calls and all(g.dtype == torch.bfloat16 and torch.isfinite(g).all() for g in grads.values())
    ref = _without_spy(lambda: reference(ids, attention_mask=mask, labels=labels))
    ref_grads = parameter_grads(reference, ref.loss)
    valid = mask.bool()
    torch.testing.assert_close(out.logits[valid].float(), ref.logits[valid].float(), rtol=0.05, atol=0.05)
    torch.testing.assert_close(out.loss.float(), ref.loss.float(), rtol=0.01, atol=0.01)
    for name in grads:
        scale = ref_grads[name].float().abs().max()
        torch.testing.assert_close(grads[name].float(), ref_grads[name].float(), rtol=0.1,
                                   atol=0.05 * scale.item(), msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decoder_in_half_precision_decodes_against_its_cache_in_place(monkeypatch, dtype):
    """A bfloat16 or float16 model's decoding step against its KV cache of
    that type (200 keys, past the decoding path's 128): attnx is handed the
    keys and values as they are (float16, or bfloat16 bits; read in place,
    no widened copy), and the step's logits are those of "sdpa" within
    bfloat16 rounding."""
    ours, reference = half_llamas(positions=256, dtype=dtype)
    ids = torch.randint(1, 97, (1, 201), generator=torch.Generator().manual_seed(2))
    steps = {}
    for name, model in (("attnx", ours), ("sdpa", reference)):
        with torch.no_grad():
            cache = model(ids[:, :200], use_cache=True).past_key_values
            calls = []
            real = attnx.softmax_attention

            def spy(q, k, v, **kwargs):
                calls.append((q.shape[-2], k.dtype, kwargs.get("_half_kv")))
                return real(q, k, v, **kwargs)

            monkeypatch.setattr(attnx, "softmax_attention", spy)
            steps[name] = model(ids[:, 200:], past_key_values=cache).logits
            monkeypatch.setattr(attnx, "softmax_attention", real)
        if name == "attnx":
            assert calls and all(call[0] == 1 and call[1].itemsize == 2 and call[2]
                                 for call in calls), calls
        else:
            assert not calls
    assert steps["attnx"].dtype == dtype
    # logits of this tiny model are below 0.4 in size; the two differ by
    # about 1e-3 (bfloat16's rounding of the attention outputs)
    torch.testing.assert_close(steps["attnx"].float(), steps["sdpa"].float(), rtol=0.02,
                               atol=0.01)


def test_encoder_compiles_without_graph_breaks(kernel_calls):
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(bert_config(), attn_implementation="attnx").eval()
    ids, mask = left_padded_batch()
    mask = mask.flip(-1)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).last_hidden_state
        got = compiled(ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


def test_decoder_attention_dropout_in_training(kernel_calls):
    """Attention dropout runs in attnx (seeded from torch's generator):
    repeatable under torch.manual_seed, absent in eval mode."""
    config = llama_config()
    config.attention_dropout = 0.5
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="attnx").double()
    ids, mask = left_padded_batch()
    model.train()
    torch.manual_seed(5)
    first = model(ids, attention_mask=mask).logits
    torch.manual_seed(5)
    second = model(ids, attention_mask=mask).logits
    torch.manual_seed(6)
    third = model(ids, attention_mask=mask).logits
    assert torch.equal(first, second) and not torch.allclose(first, third)
    first.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.eval()
    with torch.no_grad():
        plain = model(ids, attention_mask=mask).logits
        want = _without_spy(lambda: transformers.LlamaForCausalLM._from_config(
            config, attn_implementation="sdpa").double().eval())
        want.load_state_dict(model.state_dict())
        want_logits = _without_spy(lambda: want(ids, attention_mask=mask).logits)
    torch.testing.assert_close(plain, want_logits, **TOL)

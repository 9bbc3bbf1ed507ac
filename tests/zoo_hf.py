"""The Hugging Face families of the test zoo (``tests/zoo.py``): unmodified ``transformers`` models built from tiny
configs (hidden 32, 4 heads, 4 blocks, no dropout, the harness's vocabulary 64 and sequence 16), plus thin wrappers
where a family's inputs or outputs are not token logits (a vision transformer, an encoder without a head).

Every builder takes the config overrides of the zoo entry (``{"num_hidden_layers": 2}``) and returns a module that
maps ``(B, 16)`` tokens to ``(B, 16, 64)`` logits, or a Hugging Face output whose ``.logits`` are those.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor, nn

VOCAB, SEQ = 64, 16
#: What every tiny decoder shares; ``eager`` attention: the plain matmul/softmax path, the same on every layout.
_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                max_position_embeddings=SEQ, attention_dropout=0.0, attn_implementation="eager")


def hugging_face_gpt2(config: dict[str, Any]) -> nn.Module:
    """An unmodified ``transformers.GPT2LMHeadModel``: ``Conv1D`` layers, fused ``c_attn``, tied ``lm_head``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    settings = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
                    embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    return GPT2LMHeadModel(GPT2Config(**{**settings, **config}))


def hugging_face_qwen2(config: dict[str, Any]) -> nn.Module:
    """``Qwen2ForCausalLM``: grouped-query attention with biased q/k/v, the head tied to the token embedding."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(_DECODER, num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(Qwen2Config(**{**settings, **config}))


def hugging_face_phi3(config: dict[str, Any]) -> nn.Module:
    """``Phi3ForCausalLM``: one fused ``qkv_proj`` of unequal pieces (grouped-query attention), fused
    ``gate_up_proj``."""
    from transformers import Phi3Config, Phi3ForCausalLM

    settings = dict(_DECODER, num_key_value_heads=2, original_max_position_embeddings=SEQ, resid_pdrop=0.0,
                    embd_pdrop=0.0, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return Phi3ForCausalLM(Phi3Config(**{**settings, **config}))


def hugging_face_mixtral(config: dict[str, Any]) -> nn.Module:
    """``MixtralForCausalLM``: every block's MLP is a top-2 mixture of 4 experts held as 3-d parameters, run by
    Hugging Face's default experts kernel (``grouped_mm``)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    settings = dict(_DECODER, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    router_jitter_noise=0.0)
    return MixtralForCausalLM(MixtralConfig(**{**settings, **config}))


def hugging_face_gpt_neox(config: dict[str, Any]) -> nn.Module:
    """``GPTNeoXForCausalLM``: fused ``query_key_value`` (heads interleaved), parallel residual, partial rotary."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    settings = dict(_DECODER, hidden_dropout=0.0, use_parallel_residual=True, tie_word_embeddings=False)
    return GPTNeoXForCausalLM(GPTNeoXConfig(**{**settings, **config}))


def hugging_face_bert(config: dict[str, Any]) -> nn.Module:
    """``BertForMaskedLM``: bidirectional encoder, learned positions and token types, its decoder tied to the word
    embeddings."""
    from transformers import BertConfig, BertForMaskedLM

    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0, attn_implementation="eager")
    return BertForMaskedLM(BertConfig(**{**settings, **config}))


class TokensAsImageViT(nn.Module):
    """An unmodified ``ViTModel`` on tokens: each token's embedding is one 4×4 RGB patch of a 16×16 image (patch
    ``i`` is token ``i``), and the head reads the 16 patch outputs (the class token is dropped). ``ViTModel`` reads
    its patch projection's weight dtype and holds the class token and position table as parameters."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTModel

        settings = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                        image_size=16, patch_size=4, num_channels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, attn_implementation="eager")
        vit_config = ViTConfig(**{**settings, **config})
        self.patch, self.grid = vit_config.patch_size, vit_config.image_size // vit_config.patch_size
        self.channels = vit_config.num_channels
        self.pixels = nn.Embedding(VOCAB, self.channels * self.patch**2)
        self.vit = ViTModel(vit_config, add_pooling_layer=False)
        self.head = nn.Linear(vit_config.hidden_size, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        b, g, p = tokens.shape[0], self.grid, self.patch
        patches = self.pixels(tokens).view(b, g, g, self.channels, p, p)
        image = patches.permute(0, 3, 1, 4, 2, 5).reshape(b, self.channels, g * p, g * p)
        hidden = self.vit(pixel_values=image).last_hidden_state
        return self.head(hidden[:, 1:])


class T5EncoderLM(nn.Module):
    """An unmodified ``T5EncoderModel`` and a linear head: the first block owns the relative-position bias, whose
    output every later block receives as an argument."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        from transformers import T5Config, T5EncoderModel

        settings = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4, dropout_rate=0.0,
                        relative_attention_num_buckets=8, relative_attention_max_distance=SEQ,
                        attn_implementation="eager")
        t5_config = T5Config(**{**settings, **config})
        self.encoder = T5EncoderModel(t5_config)
        self.head = nn.Linear(t5_config.d_model, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(input_ids=tokens).last_hidden_state)


class BartLM(nn.Module):
    """An unmodified ``BartForConditionalGeneration`` (encoder-decoder: two block lists, cross-attention reading
    the encoder's output in every decoder block, embeddings shared by encoder, decoder and head): the tokens are
    the encoder's input and, shifted right, the decoder's."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        from transformers import BartConfig, BartForConditionalGeneration

        settings = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=SEQ,
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, attn_implementation="eager")
        if "layers" in config:
            settings.update(encoder_layers=config["layers"], decoder_layers=config["layers"])
        self.bart = BartForConditionalGeneration(BartConfig(**{**settings, **{k: v for k, v in config.items()
                                                                             if k != "layers"}}))

    def forward(self, tokens: Tensor) -> Tensor:
        return self.bart(input_ids=tokens, decoder_input_ids=tokens.roll(1, dims=1)).logits


def hugging_face_mamba(config: dict[str, Any]) -> nn.Module:
    """``MambaForCausalLM``: state-space mixers (``in_proj``, depthwise ``conv1d``, ``x_proj``, ``dt_proj``,
    ``A_log``, ``D``, ``out_proj``), its reference scan on CPU."""
    from transformers import MambaConfig, MambaForCausalLM

    settings = dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=4, expand=2, conv_kernel=4,
                    use_cache=False, tie_word_embeddings=True)
    return MambaForCausalLM(MambaConfig(**{**settings, **config}))


def hugging_face_deepseek_v3(config: dict[str, Any]) -> nn.Module:
    """``DeepseekV3ForCausalLM``: multi-head latent attention (low-rank q and kv projections with a shared rotary
    key), the first block dense and the others mixture-of-experts with a shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    settings = dict(_DECODER, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4,
                    num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
                    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                    use_cache=False)
    return DeepseekV3ForCausalLM(DeepseekV3Config(**{**settings, **config}))


def hugging_face_qwen3_moe(config: dict[str, Any]) -> nn.Module:
    """``Qwen3MoeForCausalLM``: q/k RMSNorm per head, every block a routed mixture of experts."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings = dict(_DECODER, num_key_value_heads=2, head_dim=8, moe_intermediate_size=32, num_experts=4,
                    num_experts_per_tok=2, decoder_sparse_step=1, use_cache=False)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**settings, **config}))


def hugging_face_olmo2(config: dict[str, Any]) -> nn.Module:
    """``Olmo2ForCausalLM``: q and k RMSNorm over the whole projection width, norms after attention and MLP."""
    from transformers import Olmo2Config, Olmo2ForCausalLM

    settings = dict(_DECODER, num_key_value_heads=4, use_cache=False, pad_token_id=1, eos_token_id=2)
    return Olmo2ForCausalLM(Olmo2Config(**{**settings, **config}))


def hugging_face_gpt_oss(config: dict[str, Any]) -> nn.Module:
    """``GptOssForCausalLM``: attention sinks (a learned logit per head), sliding and full attention alternating,
    experts with biases and interleaved gate|up columns (``gate_up_proj[..., ::2]``), a router with a bias."""
    from transformers import GptOssConfig, GptOssForCausalLM

    settings = dict(_DECODER, intermediate_size=32, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=8, use_cache=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    layers = config.get("num_hidden_layers", settings["num_hidden_layers"])
    settings["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
    return GptOssForCausalLM(GptOssConfig(**{**settings, **config}))


def hugging_face_zamba2(config: dict[str, Any]) -> nn.Module:
    """``Zamba2ForCausalLM``: Mamba-2 layers with, every other layer, a transformer block that all hybrid layers
    share (one module per layer, its weights tied across them by transformers). Its convolutions' biases are drawn
    as torch's ``Conv1d`` draws them (transformers starts them at zero): a zero-started bias whose gradient nearly
    cancels moves by rounding-sized amounts, so its per-tensor relative difference measured rounding, not the
    strategy (1.9e-5 under tp2 on an AMD EPYC; see ``tests/models.py`` on such choices)."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    settings = dict(_DECODER, num_key_value_heads=4, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                    mamba_ngroups=1, mamba_headdim=8, n_mamba_heads=8, num_mem_blocks=1, chunk_size=8,
                    use_shared_attention_adapter=False, adapter_rank=4, use_mem_rope=True, use_cache=False)
    settings.pop("max_position_embeddings")
    layers = config.get("num_hidden_layers", settings["num_hidden_layers"])
    settings["layers_block_type"] = ["mamba", "hybrid"] * (layers // 2)
    model = Zamba2ForCausalLM(Zamba2Config(**{**settings, **config}))
    for module in model.modules():
        if isinstance(module, nn.Conv1d) and module.bias is not None:
            bound = 1 / math.sqrt(module.weight[0].numel())
            nn.init.uniform_(module.bias, -bound, bound)
    return model


def hugging_face_llama4(config: dict[str, Any]) -> nn.Module:
    """``Llama4ForCausalLM`` (text): dense and mixture-of-experts blocks interleaved, a shared expert next to the
    routed ones, a router that is an ``nn.Linear`` returning scores and logits, chunked attention without rotary
    embeddings in some layers."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    settings = dict(_DECODER, num_key_value_heads=2, head_dim=8, intermediate_size_mlp=64, num_local_experts=4,
                    num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8, use_cache=False)
    layers = config.get("num_hidden_layers", settings["num_hidden_layers"])
    settings["no_rope_layers"] = [1, 1, 1, 0] * (layers // 4) + [1] * (layers % 4)
    return Llama4ForCausalLM(Llama4TextConfig(**{**settings, **config}))


class TokensAsImageSwin(nn.Module):
    """An unmodified hierarchical ``SwinModel`` on the tokens as a 16×16 image of embeddings (4×4 patches of a
    token each, windows of 2×2 patches, a patch-merging step between its two stages), a linear head per token
    from the last stage's features, upsampled back to the 16 positions."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        from transformers import SwinConfig, SwinModel

        settings = dict(image_size=16, patch_size=4, num_channels=4, embed_dim=16, depths=[2, 2], num_heads=[2, 4],
                        window_size=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                        drop_path_rate=0.0)
        if "layers" in config:
            settings["depths"] = [config["layers"], config["layers"]]
        swin_config = SwinConfig(**{**settings, **{k: v for k, v in config.items() if k != "layers"}})
        self.embed = nn.Embedding(VOCAB, 4 * 4 * 4)  # a 4×4 patch of 4 channels per token
        self.swin = SwinModel(swin_config)
        self.head = nn.Linear(swin_config.embed_dim * 2, 4 * VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        b = tokens.shape[0]
        patches = self.embed(tokens).view(b, 4, 4, 4, 4, 4)  # (b, row, col, channel, y, x)
        image = patches.permute(0, 3, 1, 4, 2, 5).reshape(b, 4, 16, 16)
        features = self.swin(pixel_values=image).last_hidden_state  # (b, 4, 2·embed): 2×2 merged patches
        return self.head(features).view(b, 4, 4, VOCAB).reshape(b, SEQ, VOCAB)


class TokensAsLatentsDiT(nn.Module):
    """An unmodified class-conditional ``diffusers.DiTTransformer2DModel`` in a denoising step on the tokens: their
    embeddings laid out as a 4×8×8 latent (a token per 2×2 patch), noised by a timestep and noise both drawn from the
    tokens (the same on every rank and microbatch), the class label the first token; the predicted noise, patch by
    patch, gives each token's logits. Its forward calls ``transformer_blocks[0].norm1.emb`` after the trunk."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        from diffusers import DiTTransformer2DModel

        settings = dict(num_attention_heads=4, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=4,
                        dropout=0.0, norm_num_groups=1, sample_size=8, patch_size=2, num_embeds_ada_norm=VOCAB)
        if "layers" in config:
            settings["num_layers"] = config["layers"]
        self.dit = DiTTransformer2DModel(**{**settings, **{k: v for k, v in config.items() if k != "layers"}})
        for block in self.dit.transformer_blocks:  # no class-label dropout, as the zoo trains without dropout
            block.norm1.emb.class_embedder.dropout_prob = 0.0
        self.embed = nn.Embedding(VOCAB, 4 * 2 * 2)  # a 2×2 patch of 4 channels per token
        self.head = nn.Linear(4 * 2 * 2, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        import torch

        b = tokens.shape[0]
        latents = self.embed(tokens).view(b, 4, 4, 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, 4, 8, 8)
        noise = torch.sin(tokens.float().repeat_interleave(16, dim=1).view(b, 4, 8, 8) * 1.7)
        timestep = tokens.sum(dim=1) % 1000
        alpha = (1.0 - timestep.float() / 1000.0).view(b, 1, 1, 1)
        noised = alpha.sqrt() * latents + (1.0 - alpha).sqrt() * noise
        predicted = self.dit(noised, timestep=timestep, class_labels=tokens[:, 0]).sample  # (b, 4, 8, 8)
        patches = predicted.view(b, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, SEQ, 16)
        return self.head(patches - noise.view(b, 4, 4, 2, 4, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, SEQ, 16))


def peft_lora_llama(config: dict[str, Any]) -> nn.Module:
    """A ``LlamaForCausalLM`` wrapped by PEFT's ``get_peft_model`` with LoRA adapters on q/v and the MLP's down
    projection: the base frozen, only the adapters train."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(**{**_DECODER, "num_key_value_heads": 2, **config}))
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "down_proj"],
                      init_lora_weights="gaussian")
    return get_peft_model(base, lora)


def litgpt_gpt(config: dict[str, Any]) -> nn.Module:
    """litgpt's own ``GPT`` (Lightning's LLM library; ``transformer = ModuleDict(wte=..., h=..., ln_f=...)``), a
    Llama-style configuration. Not in the test extra: litgpt 0.5 pins ``huggingface-hub<1.4``, which transformers 5
    excludes, so the test command installs it without its dependencies (its model code needs none we lack)."""
    from litgpt.config import Config
    from litgpt.model import GPT

    settings = dict(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=32,
                    n_query_groups=2, rotary_percentage=1.0, parallel_residual=False, bias=False,
                    norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", intermediate_size=64)
    return GPT(Config(**{**settings, **config}))

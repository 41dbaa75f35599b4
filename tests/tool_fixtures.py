"""A tiny Qwen2 checkpoint that answers every chat turn with a fixed tool call, in
Qwen2.5's chat format, for end-to-end tests of tool calls and exact multi-turn tokens.

The tokenizer is character level over printable ASCII, plus Qwen's special tokens and a few
multi-character added tokens. The model has one transformer layer whose attention and MLP
outputs are zero, so each next token is a function of the current token only: one-hot
embeddings and a hand-set ``lm_head`` make greedy decoding follow the chain

    "\\n" -> <tool_call> -> CALL_A -> CALL_B -> </tool_call> -> <|im_end|>

from the generation prompt's final "\\n". ``CALL_A + CALL_B`` is the body of a
``get_weather(city="Paris")`` call, and the vocabulary also holds ``CALL_A + CALL_B`` as one
token, so re-tokenizing the call's text gives *other* tokens than the model generated (as
BPE merges across the boundary of generated tokens do in real models).

``QWEN25_TEMPLATE`` is Qwen2.5's chat template (tools in the system prompt inside
``<tools></tools>``, calls as ``<tool_call>`` JSON, results as ``<tool_response>``).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

QWEN25_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user "
    "query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:"
    "\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": "
    "<function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first)"
    " or (message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + "
    "'\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CALL_A = '\n{"name": "get_weather", '
CALL_B = '"arguments": {"city": "Paris"}}\n'
ADDED = ["<tool_call>", "</tool_call>", CALL_A, CALL_B, CALL_A + CALL_B]
CHARS = [c for c in string.printable if c not in "\x0b\x0c"]
VOCAB = SPECIALS + CHARS + ADDED + ["<unk>"]
PAD_ROW = "<padding row>"  # a model row past the tokenizer's vocabulary (padded_vocab)
PAD_ID = len(VOCAB) + 1
TOOL_CALL_TEXT = "<tool_call>" + CALL_A + CALL_B + "</tool_call>"
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _tokenizer_json() -> dict[str, Any]:
    ids = {tok: i for i, tok in enumerate(VOCAB)}
    added = [{"id": ids[t], "content": t, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": t in SPECIALS + ["<unk>"]}
             for t in SPECIALS + ADDED + ["<unk>"]]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"},
                              "behavior": "Isolated", "invert": False},
            "post_processor": None, "decoder": {"type": "Fuse"},
            "model": {"type": "WordLevel", "vocab": ids, "unk_token": "<unk>"}}


def tool_chat_model_dir(tmp_path_factory: Any, name: str = "toolchat",
                        padded_vocab: bool = False) -> Path:
    """The checkpoint folder (config, safetensors, tokenizer, chat template).

    With ``padded_vocab`` the model's vocabulary is 4 rows larger than the tokenizer's (as
    real checkpoints pad theirs) and the call is written ``CALL_A, PAD_ID, CALL_B``: the
    padding id decodes to nothing, so the text is the same call."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    out = tmp_path_factory.mktemp(name) / "qwen2-tools"
    out.mkdir()
    ids = {tok: i for i, tok in enumerate(VOCAB)}
    vocab = len(VOCAB) + (4 if padded_vocab else 0)
    hidden = 128
    assert vocab <= hidden, "one-hot embeddings need hidden_size >= vocab"
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, rms_norm_eps=1e-6,
                         tie_word_embeddings=False, bos_token_id=ids["<|im_start|>"],
                         eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    chain = {"\n": "<tool_call>", "<tool_call>": CALL_A, CALL_A: CALL_B,
             CALL_B: "</tool_call>"}
    if padded_vocab:
        ids[PAD_ROW] = PAD_ID
        chain.update({CALL_A: PAD_ROW, PAD_ROW: CALL_B})
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.fill_(1.0)
        model.model.embed_tokens.weight[:, :vocab].copy_(torch.eye(vocab))
        head = model.lm_head.weight  # [V, D]
        for tok, i in ids.items():
            head[ids[chain.get(tok, "<|im_end|>")], i] = 1.0
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(json.dumps(_tokenizer_json()))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": "<unk>", "model_max_length": 2048,
        "clean_up_tokenization_spaces": False}))
    (out / "chat_template.jinja").write_text(QWEN25_TEMPLATE)
    return out

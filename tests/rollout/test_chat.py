from rollout.chat import ChatMLFormat, GLMFormat, Message, make_chat_format


def test_chatml_continuation_equals_full_render():
    fmt = ChatMLFormat()
    history = [Message("system", "S"), Message("user", "U")]
    reply = "I will act."
    obs = [Message("tool", "result")]
    full = fmt.render(history + [Message("assistant", reply)] + obs, add_generation_prompt=True)
    # the model's output ends with its stop token, which the continuation must not repeat
    streamed = fmt.render(history) + reply + "<|im_end|>" + fmt.continuation(obs, reply + "<|im_end|>", True)
    assert streamed == full
    # an output cut by the token budget gets its turn closed by the continuation
    cut = fmt.render(history) + reply + fmt.continuation(obs, reply, True)
    assert cut == full


def test_glm_continuation_equals_full_render():
    fmt = GLMFormat()
    history = [Message("system", "S"), Message("user", "U")]
    reply = "<tool_call>bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>"
    obs = [Message("tool", "a.py")]
    full = fmt.render(history + [Message("assistant", reply)] + obs, add_generation_prompt=True)
    streamed = fmt.render(history) + reply + "<|observation|>" + fmt.continuation(obs, reply + "<|observation|>",
                                                                                   True)
    assert full.startswith("[gMASK]<sop><|system|>") and streamed == full


def test_token_ledger_matches_tokenised_full_render(tokenizer):
    """Appending continuation tokens gives the same ids as tokenising the whole conversation."""
    fmt = make_chat_format("chatml")
    history = [Message("system", "You are helpful."), Message("user", "Add 2 and 3.")]
    reply_ids = tokenizer("The answer is 5.", add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids = tokenizer(fmt.render(history, add_generation_prompt=False), add_special_tokens=False)["input_ids"]
    ids += tokenizer(fmt.generation_prompt(), add_special_tokens=False)["input_ids"] + reply_ids
    obs = [Message("tool", "ok")]
    ids += tokenizer(fmt.continuation(obs, tokenizer.decode(reply_ids[-2:])), add_special_tokens=False)["input_ids"]
    full = fmt.render(history + [Message("assistant", "The answer is 5.")] + obs, add_generation_prompt=False)
    assert ids == tokenizer(full, add_special_tokens=False)["input_ids"]
    assert fmt.stop_token_ids(tokenizer) == [tokenizer.convert_tokens_to_ids("<|im_end|>")]

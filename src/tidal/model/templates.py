"""Chat templates the runtime falls back on: a model whose tokenizer has none still plays multi-turn
trajectories (rollout.agent)."""

# A small tool-capable chat template for a character-level tokenizer without one of its own (the demo's tiny
# model; multi-turn rollouts need one): short role
# tags, since every character is a token, and the tools by name only. An assistant turn ends with
# EOS, which the engine samples; every other message ends with a newline.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools %}{{ 'tools: ' }}{% for t in tools %}{{ t.function.name }}{% if not loop.last %}{{ ',' }}{% endif %}{% endfor %}{{ '\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}{{ '<a>' + m.content + eos_token }}"
    "{%- elif m.role == 'tool' %}{{ '<t>' + m.content + '\n' }}"
    "{%- elif m.role == 'system' %}{{ '<s>' + m.content + '\n' }}"
    "{%- else %}{{ '<u>' + m.content + '\n' }}{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<a>' }}{% endif %}"
)

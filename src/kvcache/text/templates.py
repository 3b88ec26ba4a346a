"""Chat templates for GGUF files that ship none (as llama.cpp keeps built-in ones by model).

Gemma 3's turns: ``<start_of_turn>user|model`` then the content and ``<end_of_turn>``; a
system message has no turn of its own (Gemma has no system role): it opens the first user
turn, followed by a blank line. Roles after the system message alternate user, assistant.
"""

from __future__ import annotations

GEMMA = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] | trim + '\\n\\n' %}"
    "{% set turns = messages[1:] %}"
    "{% else %}"
    "{% set prefix = '' %}"
    "{% set turns = messages %}"
    "{% endif %}"
    "{% for m in turns %}"
    "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user, assistant, user, ... after the system message') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' }}"
    "{{ (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)

# general.architecture -> the template used when the file has no tokenizer.chat_template
BUILTIN: dict[str, str] = {"gemma3": GEMMA}

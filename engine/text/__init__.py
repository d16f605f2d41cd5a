"""Text in and out: Kimi's tokenizer (tokenizer.py), the chat template and the output parser
(chat_template.py), and the toy BPE trainer that writes test vocabularies (bpe_train.py)."""

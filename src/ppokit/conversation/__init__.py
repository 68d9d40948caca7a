"""How a conversation becomes the text and token ids the model sees: chat templates (templates) and the conversation renderer."""

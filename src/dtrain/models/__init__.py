"""Models dtrain ships, in every worker: the byte-level GPT the default job trains."""

"""The reconstruct stage: prompts + responses -> exact token ids and loss masks, as the target saw them.

Chat-template rendering, completion formats, tokenizer loading, special-token pins and multi-turn masks all live
here, because each one decides an id; `stage.reconstruct_part` is the stage's entry point.
"""

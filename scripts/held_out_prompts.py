"""Prompts the packaged default model never trained on, for the scripts that time it."""

# First words of the first verse of held-out chapters (Genesis 50, Job 14, Psalms 22, Psalms 122, Proverbs 22,
# Isaiah 21, Jeremiah 5, Lamentations 3): the validation split of docs/default_model_data.md.
HELD_OUT_PROMPTS = [
    "And Joseph fell upon his father's face,",
    "Man that is born of a woman",
    "My God, my God, why hast thou",
    "I was glad when they said unto me,",
    "A good name is rather to be chosen",
    "The burden of the desert of the sea.",
    "Run ye to and fro through the streets of Jerusalem,",
    "I am the man that hath seen affliction",
]

"""Text data that several stages read: the training/validation corpus (:mod:`.corpus`) and the
held-out token set of quantized parity with the KL figures measured on it (:mod:`.heldout`).
Below convert, train, export and evaluate, so none of them imports another stage for its data."""

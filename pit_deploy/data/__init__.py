"""Text data that several stages read: the training/validation corpus (:mod:`.corpus`), the
held-out token set of quantized parity with the KL figures measured on it (:mod:`.heldout`), and
the calibration text of calibrated rounding (:mod:`.calibration`). Below convert, train, export
and evaluate, so none of them imports another stage for its data.
"""

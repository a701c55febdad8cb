"""The wire: records and codecs both sides of a round read and write (plaintext, masking, CKKS)."""

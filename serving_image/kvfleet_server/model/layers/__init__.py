"""Model building blocks whose storage format is chosen at load: the one ``Linear`` (quant method
plugged in) and the vocabulary embedding."""

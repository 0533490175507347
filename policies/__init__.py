"""The gpu-serving CrossGuard policy pack (`pulumi preview --policy-pack policies`)."""

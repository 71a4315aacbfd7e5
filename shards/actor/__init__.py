"""What runs inside one stage actor: loading only its stage and running batches, reduced
precision, trimming the heap after a load, measuring the memory it holds, and TensorFlow's
logging."""

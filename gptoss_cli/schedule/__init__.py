"""Microbatch schedules: the plain schedule, combined 1F1B with EP overlap, delayed weight gradients."""

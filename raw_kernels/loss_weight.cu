// The loss weight of data-parallel training, computed on the device from a count of valid targets.
//
// Each rank uploads its valid-target count with its targets; after the count's all-reduce,
// loss_weight_from_count writes d_loss = 1/max(count, 1), the weight of one valid target's loss,
// which the classifier reads on the device. The quotient is taken in fp64 and rounded once to fp32,
// exactly as the one-GPU path computes it on the host (a Python float stored into fp32), so one
// and several GPUs weigh tokens by the same bits. Outputs (all `=`): d_loss, and optionally
// count_out (the count itself, for the host to read with the losses). d_loss may share its four
// bytes with count (the upload carries the count in d_loss's slot): the count is read first.
// kernels

extern "C" __global__ void __launch_bounds__(1)
    loss_weight_from_count(float* d_loss, int* count_out, const int* count) {
    const int n = count[0];
    if (count_out != nullptr) count_out[0] = n;
    d_loss[0] = (float)(1.0 / (double)(n > 1 ? n : 1));
}

// launchers: cuengine/kernels/loss_weight.py (loss_weight_from_count)

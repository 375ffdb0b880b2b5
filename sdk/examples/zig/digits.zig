//! The digits classifier in Zig (see sdk/examples/c/digits.c): a linear model trained by
//! scikit-learn on load_digits, run by the host's tensor ops on held-out images.
//!
//!   classify(x, w, b, labels, pred, n, d, k) -> correct predictions (>= 0) or an error code
//!       pred = argmax_rows(x[n, d] @ w[d, k] + b[k]), written to the client buffer `pred`;
//!       logs the accuracy against `labels`.
const std = @import("std");
const twt = @import("tensorwasm");

fn classifyAll(x: twt.Handle, w: twt.Handle, b: twt.Handle, labels: twt.Handle, pred: twt.Handle,
               n: i64, d: i64, k: i64) !i64 {
    if (n <= 0 or d <= 0 or k <= 0) return error.Invalid;
    const count: usize = @intCast(n);
    const scores = try twt.alloc(n * k * 4);
    defer twt.free(scores) catch {};
    const gpa = std.heap.wasm_allocator;
    const best = try gpa.alloc(i32, count);
    defer gpa.free(best);
    const truth = try gpa.alloc(i32, count);
    defer gpa.free(truth);
    try twt.matmul_f32(x, w, scores, n, d, k);
    try twt.add_rows_f32(scores, b, n, k);
    try twt.argmax_rows_f32(scores, n, k, best);
    try twt.write(pred, 0, std.mem.sliceAsBytes(best));
    try twt.read(labels, 0, std.mem.sliceAsBytes(truth));
    var correct: i64 = 0;
    for (best, truth) |p, t| correct += @intFromBool(p == t);
    const accuracy = @as(f64, @floatFromInt(correct)) / @as(f64, @floatFromInt(n));
    var line: [128]u8 = undefined;
    twt.log(std.fmt.bufPrint(&line, "digits: {d} of {d} held-out images correct, accuracy {d:.4}",
        .{ correct, n, accuracy }) catch "digits: done") catch {};
    return correct;
}

export fn classify(x: twt.Handle, w: twt.Handle, b: twt.Handle, labels: twt.Handle, pred: twt.Handle,
                   n: i64, d: i64, k: i64) i64 {
    return classifyAll(x, w, b, labels, pred, n, d, k) catch |err| twt.toCode(err);
}

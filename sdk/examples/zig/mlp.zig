//! The demo's 2-layer MLP (worker/guests/mlp.wat) in Zig; the same exports as sdk/examples/c/mlp.c.
//!
//!   forward(x, w1, b1, w2, b2, out, batch, d_in, hidden, d_out) -> 0 or the first error code
//!       out = softmax_rows(relu(x @ w1 + b1) @ w2 + b2)
//!   classes(out, batch, d_out) -> the sum over rows of argmax(out[row]), or the error code
const std = @import("std");
const twt = @import("tensorwasm");

fn layers(x: twt.Handle, w1: twt.Handle, b1: twt.Handle, w2: twt.Handle, b2: twt.Handle, out: twt.Handle,
          batch: i64, d_in: i64, hidden: i64, d_out: i64) twt.Error!void {
    const h = try twt.alloc(batch * hidden * 4);
    defer twt.free(h) catch {};
    try twt.matmul_f32(x, w1, h, batch, d_in, hidden);
    try twt.add_rows_f32(h, b1, batch, hidden);
    try twt.unary_f32(.relu, h, h, batch * hidden);
    try twt.matmul_f32(h, w2, out, batch, hidden, d_out);
    try twt.add_rows_f32(out, b2, batch, d_out);
    try twt.softmax_rows_f32(out, batch, d_out);
}

export fn forward(x: twt.Handle, w1: twt.Handle, b1: twt.Handle, w2: twt.Handle, b2: twt.Handle, out: twt.Handle,
                  batch: i64, d_in: i64, hidden: i64, d_out: i64) i32 {
    layers(x, w1, b1, w2, b2, out, batch, d_in, hidden, d_out) catch |err| return twt.toCode(err);
    return 0;
}

export fn classes(out: twt.Handle, batch: i64, d_out: i64) i64 {
    const n: usize = @intCast(@max(batch, 0));
    const best = std.heap.wasm_allocator.alloc(i32, n) catch return twt.code.INVALID;
    defer std.heap.wasm_allocator.free(best);
    twt.argmax_rows_f32(out, batch, d_out, best) catch |err| return twt.toCode(err);
    var sum: i64 = 0;
    for (best) |c| sum += c;
    return sum;
}

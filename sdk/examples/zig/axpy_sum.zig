//! axpy + sum in Zig: y = a*x + y on two client buffers, then sum(y) (sdk/examples/c/axpy_sum.c in C).
//!
//!   twt build sdk/examples/zig/axpy_sum.zig -o axpy_sum.wasm
//!
//! run(x, y, n, a) -> sum(y) after y = a*x + y, or NaN on an error (logged).
//! x is copied into a scratch buffer through a chunk of guest memory from the
//! allocator, to show both directions of the copy.
const std = @import("std");
const twt = @import("tensorwasm");

const chunk_bytes = 64 * 1024;

fn axpySum(x: twt.Handle, y: twt.Handle, n: i64, a: f32) !f32 {
    const bytes = n * 4;
    const scratch = try twt.alloc(bytes);
    defer twt.free(scratch) catch {};
    const chunk = try std.heap.wasm_allocator.alloc(u8, chunk_bytes);
    defer std.heap.wasm_allocator.free(chunk);
    var off: i64 = 0;
    while (off < bytes) : (off += chunk_bytes) {
        const len: usize = @intCast(@min(bytes - off, chunk_bytes));
        try twt.read(x, off, chunk[0..len]);
        try twt.write(scratch, off, chunk[0..len]);
    }
    try twt.axpy_f32(n, a, scratch, y);
    const total = try twt.sum_f32(y, n);
    var line: [128]u8 = undefined;
    twt.log(std.fmt.bufPrint(&line, "axpy_sum: n={d} sum={d}", .{ n, total }) catch "axpy_sum: done") catch {};
    return total;
}

export fn run(x: twt.Handle, y: twt.Handle, n: i64, a: f32) f32 {
    return axpySum(x, y, n, a) catch |err| {
        twt.log(@errorName(err)) catch {};
        return std.math.nan(f32);
    };
}

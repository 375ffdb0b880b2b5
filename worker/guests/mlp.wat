;; A 2-layer MLP on a batch, the shape of a real inference tenant (twt demo, docs/WASM-ABI.md).
;;
;;   forward(x, w1, b1, w2, b2, out, batch, d_in, hidden, d_out) -> i32
;;       h   = relu(x[batch, d_in] @ w1[d_in, hidden] + b1)      h: a run-scoped buffer
;;       out = softmax_rows(h @ w2[hidden, d_out] + b2)          out: the caller's buffer
;;     0, or the first negative code of a host call (e.g. GPU_QUOTA for h).
;;
;;   classes(out, batch, d_out) -> i64
;;       the sum over rows of argmax(out[row]) (argmax_rows_f32 into linear memory), or the
;;       negative code; a cheap second check of the predictions. batch <= 16384 (one page).
(module
  (import "tensorwasm" "alloc" (func $alloc (param i64) (result i64)))
  (import "tensorwasm" "free" (func $free (param i64) (result i32)))
  (import "tensorwasm" "matmul_f32" (func $matmul (param i64 i64 i64 i64 i64 i64) (result i32)))
  (import "tensorwasm" "add_rows_f32" (func $add_rows (param i64 i64 i64 i64) (result i32)))
  (import "tensorwasm" "unary_f32" (func $unary (param i32 i64 i64 i64) (result i32)))
  (import "tensorwasm" "softmax_rows_f32" (func $softmax (param i64 i64 i64) (result i32)))
  (import "tensorwasm" "argmax_rows_f32" (func $argmax (param i64 i64 i64 i32) (result i32)))

  (memory (export "memory") 1 1)

  (func (export "forward")
    (param $x i64) (param $w1 i64) (param $b1 i64) (param $w2 i64) (param $b2 i64) (param $out i64)
    (param $batch i64) (param $d_in i64) (param $hidden i64) (param $d_out i64)
    (result i32)
    (local $h i64) (local $rc i32)
    ;; the hidden activations: batch x hidden floats, owned by this run
    (local.set $h (call $alloc (i64.mul (i64.mul (local.get $batch) (local.get $hidden)) (i64.const 4))))
    (if (i64.lt_s (local.get $h) (i64.const 0)) (then (return (i32.wrap_i64 (local.get $h)))))
    (block $fail
      (local.set $rc (call $matmul (local.get $x) (local.get $w1) (local.get $h)
                                   (local.get $batch) (local.get $d_in) (local.get $hidden)))
      (br_if $fail (local.get $rc))
      (local.set $rc (call $add_rows (local.get $h) (local.get $b1) (local.get $batch) (local.get $hidden)))
      (br_if $fail (local.get $rc))
      ;; op 0: relu, in place
      (local.set $rc (call $unary (i32.const 0) (local.get $h) (local.get $h)
                                  (i64.mul (local.get $batch) (local.get $hidden))))
      (br_if $fail (local.get $rc))
      (local.set $rc (call $matmul (local.get $h) (local.get $w2) (local.get $out)
                                   (local.get $batch) (local.get $hidden) (local.get $d_out)))
      (br_if $fail (local.get $rc))
      (local.set $rc (call $add_rows (local.get $out) (local.get $b2) (local.get $batch) (local.get $d_out)))
      (br_if $fail (local.get $rc))
      (local.set $rc (call $softmax (local.get $out) (local.get $batch) (local.get $d_out))))
    (drop (call $free (local.get $h)))
    (local.get $rc))

  (func (export "classes") (param $out i64) (param $batch i64) (param $d_out i64) (result i64)
    (local $rc i32) (local $i i32) (local $n i32) (local $sum i64)
    (local.set $rc (call $argmax (local.get $out) (local.get $batch) (local.get $d_out) (i32.const 0)))
    (if (local.get $rc) (then (return (i64.extend_i32_s (local.get $rc)))))
    (local.set $n (i32.wrap_i64 (local.get $batch)))
    (block $done
      (loop $l
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (local.set $sum (i64.add (local.get $sum)
                                 (i64.extend_i32_s (i32.load (i32.shl (local.get $i) (i32.const 2))))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $l)))
    (local.get $sum))
)

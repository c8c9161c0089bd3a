import Metal
#if canImport(Glibc)
import Glibc
#elseif canImport(Darwin)
import Darwin
#endif

/// Metal memory a kernel binds directly: a buffer pyfa allocated, or caller
/// memory wrapped in place (page-aligned). Shared storage, so its contents
/// are the bytes kernels use.
final class MetalBufferMemory: BufferMemory {
    let buffer: MTLBuffer

    init(buffer: MTLBuffer) { self.buffer = buffer }

    var hostPointer: UnsafeMutableRawPointer? { buffer.contents() }
    var deviceAddress: UInt64 { UInt64(UInt(bitPattern: buffer.contents())) }

    func write(offset: Int, from: UnsafeRawPointer, count: Int) throws {
        if count > 0 { memcpy(buffer.contents() + offset, from, count) }
    }

    func read(offset: Int, into: UnsafeMutableRawPointer, count: Int) throws {
        if count > 0 { memcpy(into, buffer.contents() + offset, count) }
    }
}

/// Caller memory Metal cannot wrap (not page-aligned): kernels bind a copy.
/// The queue uploads the caller's bytes before a command buffer that uses it
/// runs and, once it completed without error, writes back the bytes kernels
/// changed (so memory kernels only read, possibly read-only, is never
/// written); the host pointer stays the caller's, so host reads and writes
/// between calls need no sync.
final class MetalCopiedMemory: BufferMemory {
    let buffer: MTLBuffer
    let host: UnsafeMutableRawPointer
    let bytes: Int

    init(buffer: MTLBuffer, host: UnsafeMutableRawPointer, bytes: Int) {
        self.buffer = buffer
        self.host = host
        self.bytes = bytes
    }

    var hostPointer: UnsafeMutableRawPointer? { host }
    var deviceAddress: UInt64 { UInt64(UInt(bitPattern: host)) }

    func write(offset: Int, from: UnsafeRawPointer, count: Int) throws {
        if count > 0 { memcpy(host + offset, from, count) }
    }

    func read(offset: Int, into: UnsafeMutableRawPointer, count: Int) throws {
        if count > 0 { memcpy(into, host + offset, count) }
    }

    func upload() { if bytes > 0 { memcpy(buffer.contents(), host, bytes) } }

    /// Copies back the chunks that differ from the caller's bytes.
    func download() {
        let chunk = 4096
        let copy = buffer.contents()
        var offset = 0
        while offset < bytes {
            let n = min(chunk, bytes - offset)
            if memcmp(host + offset, copy + offset, n) != 0 { memcpy(host + offset, copy + offset, n) }
            offset += n
        }
    }
}

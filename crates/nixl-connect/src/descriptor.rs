//! [`Descriptor`]: one range of memory an operation moves, owned or borrowed.
//!
//! A descriptor owns its memory (a [`HostBuffer`], `Vec<T>`, `Box<[T]>`, `bytes::BytesMut`), or
//! borrows it for `'a` (`&[u8]`, `&mut [u8]`, `&HostBuffer`, `&mut HostBuffer`), or wraps a raw
//! pointer through the `unsafe` [`Descriptor::from_raw_parts`]. Operations hold their descriptors,
//! so borrowed memory cannot be freed while NIXL may still touch it: the borrow checker sees to it.
//!
//! Shared borrows (`&[u8]`, `&HostBuffer`) are read-only: they can be exposed by a
//! [`ReadableOperation`](crate::ReadableOperation) or sent by a
//! [`WriteOperation`](crate::WriteOperation), but never written into; using one as a destination
//! is [`Error::InvalidArgument`].

use std::any::Any;
use std::fmt;

use crate::buffer::HostBuffer;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::metadata::SerializedDescriptor;
use crate::reg::RegToken;

#[cfg(feature = "cuda")]
mod cuda;

pub(crate) mod sealed {
    pub trait Sealed {}
}

/// Plain-old-data element types whose slices may be moved as raw bytes.
pub trait Plain: sealed::Sealed + Copy + Send + Sync + 'static {}
macro_rules! plain {
    ($($t:ty),*) => { $(impl sealed::Sealed for $t {} impl Plain for $t {})* };
}
plain!(u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, f32, f64);

/// Memory a descriptor may own. Implemented for [`HostBuffer`], `Arc<HostBuffer>` (read-only,
/// shared), `Vec<T>`, `Box<[T]>` and `bytes::BytesMut` (with `T:` [`Plain`]); sealed.
pub trait OwnedMemory: sealed::Sealed + Any + Send + Sync {
    #[doc(hidden)]
    fn raw(&self) -> (usize, usize);
    #[doc(hidden)]
    fn host_buffer(&self) -> Option<&HostBuffer> {
        None
    }
    #[doc(hidden)]
    fn writable(&self) -> bool {
        true
    }
    #[doc(hidden)]
    fn vouched(&self) -> bool {
        false
    }
}

/// Memory owned by something else that a descriptor keeps alive (a Python buffer object, another
/// library's allocation), described by a pointer the caller vouches for.
struct Kept {
    _owner: Box<dyn Any + Send + Sync>,
    ptr: usize,
    len: usize,
    writable: bool,
}

impl sealed::Sealed for Kept {}
impl OwnedMemory for Kept {
    fn raw(&self) -> (usize, usize) {
        (self.ptr, self.len)
    }
    fn writable(&self) -> bool {
        self.writable
    }
    fn vouched(&self) -> bool {
        true
    }
}

impl sealed::Sealed for HostBuffer {}
impl OwnedMemory for HostBuffer {
    fn raw(&self) -> (usize, usize) {
        (self.as_ptr() as usize, self.len())
    }
    fn host_buffer(&self) -> Option<&HostBuffer> {
        Some(self)
    }
}
/// A [`HostBuffer`] shared by reference count: read-only, cheap to clone, and exposed again and
/// again through its one registration (kept in the buffer, so every clone finds it). The last
/// clone to go frees the buffer, quarantining its pages if a peer was ever told of them.
impl sealed::Sealed for std::sync::Arc<HostBuffer> {}
impl OwnedMemory for std::sync::Arc<HostBuffer> {
    fn raw(&self) -> (usize, usize) {
        (self.as_ptr() as usize, self.len())
    }
    fn host_buffer(&self) -> Option<&HostBuffer> {
        Some(self)
    }
    fn writable(&self) -> bool {
        false
    }
}
impl<T: Plain> sealed::Sealed for Vec<T> {}
impl<T: Plain> OwnedMemory for Vec<T> {
    fn raw(&self) -> (usize, usize) {
        (self.as_ptr() as usize, std::mem::size_of_val(self.as_slice()))
    }
}
impl<T: Plain> sealed::Sealed for Box<[T]> {}
impl<T: Plain> OwnedMemory for Box<[T]> {
    fn raw(&self) -> (usize, usize) {
        (self.as_ptr() as usize, std::mem::size_of_val(&**self))
    }
}
impl sealed::Sealed for bytes::BytesMut {}
impl OwnedMemory for bytes::BytesMut {
    fn raw(&self) -> (usize, usize) {
        (self.as_ptr() as usize, self.len())
    }
}

enum Mem<'a> {
    Owned(Box<dyn OwnedMemory>),
    /// All or part of a borrowed [`HostBuffer`] (`writable` when borrowed mutably).
    BufferPart {
        buf: &'a HostBuffer,
        off: usize,
        len: usize,
        writable: bool,
    },
    Slice(&'a [u8]),
    SliceMut(&'a mut [u8]),
    Raw {
        ptr: usize,
        len: usize,
    },
    /// Memory borrowed for `'a` that only the driver can touch (device memory).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Extern {
        ptr: usize,
        len: usize,
        writable: bool,
        _life: std::marker::PhantomData<&'a ()>,
    },
}

/// One contiguous range of memory on one device.
///
/// Dropping a descriptor releases the NIXL registrations it holds (a [`HostBuffer`] keeps its own
/// registrations until the buffer itself is dropped), then drops or releases its memory.
pub struct Descriptor<'a> {
    mem: Mem<'a>,
    device: Device,
    regs: Vec<RegToken>,
    /// The stream whose work queued before an operation must finish before the operation starts.
    producer: ProducerSlot,
}

/// Where a descriptor keeps its producer stream (nothing without the `cuda` feature).
#[cfg(feature = "cuda")]
type ProducerSlot = Option<crate::cuda::Producer>;
#[cfg(not(feature = "cuda"))]
type ProducerSlot = ();

impl<'a> Descriptor<'a> {
    fn make(mem: Mem<'a>, device: Device) -> Self {
        Self {
            mem,
            device,
            regs: Vec::new(),
            producer: Default::default(),
        }
    }

    /// The stream an operation over this descriptor waits for before it starts.
    #[cfg(feature = "cuda")]
    pub(crate) fn producer(&self) -> Option<&crate::cuda::Producer> {
        self.producer.as_ref()
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn set_producer(&mut self, p: crate::cuda::Producer) {
        self.producer = Some(p);
    }

    /// A descriptor over memory it owns.
    pub fn owned<M: OwnedMemory>(m: M) -> Self {
        Self::make(Mem::Owned(Box::new(m)), Device::Host)
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn owned_on(m: Box<dyn OwnedMemory>, device: Device) -> Self {
        Self::make(Mem::Owned(m), device)
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn borrowed_raw(
        ptr: usize,
        len: usize,
        device: Device,
        writable: bool,
        _life: std::marker::PhantomData<&'a ()>,
    ) -> Self {
        Self::make(
            Mem::Extern {
                ptr,
                len,
                writable,
                _life,
            },
            device,
        )
    }

    /// A descriptor over raw memory.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid memory on `device`, readable (and writable, if the descriptor
    /// is used as a destination) for as long as the descriptor or any operation holding it lives,
    /// and not otherwise accessed while a transfer into it is in flight.
    ///
    /// The library treats it as borrowed memory: dropping an operation over it blocks until no
    /// transport can touch it any more (the same-host path stops within one copy chunk; a NIXL
    /// transfer gets the connector's cancel grace, then its agent is destroyed), so the memory may
    /// be freed as soon as the descriptor and every operation holding it are gone.
    #[allow(unsafe_code)] // an unsafe constructor: memory is raw here
    pub unsafe fn from_raw_parts(ptr: *mut u8, len: usize, device: Device) -> Descriptor<'static> {
        let ptr = ptr as usize;
        Descriptor::make(Mem::Raw { ptr, len }, device)
    }

    /// A descriptor over raw memory that `owner` keeps valid: the descriptor (and any operation
    /// holding it, or the engine after the operation is dropped) keeps `owner` alive until no
    /// transfer can touch the memory. For bindings handing over memory owned by another runtime.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid memory on `device` for as long as `owner` lives, readable,
    /// and writable when `writable`, and not otherwise accessed while a transfer into it is in
    /// flight.
    #[allow(unsafe_code)] // an unsafe constructor: memory is raw here
    pub unsafe fn from_raw_parts_with_owner(
        ptr: *mut u8,
        len: usize,
        device: Device,
        writable: bool,
        owner: impl Any + Send + Sync,
    ) -> Descriptor<'static> {
        Descriptor::make(
            Mem::Owned(Box::new(Kept {
                _owner: Box::new(owner),
                ptr: ptr as usize,
                len,
                writable,
            })),
            device,
        )
    }

    /// A descriptor over raw device memory, checked against the pointer's attributes.
    ///
    /// Operations over it wait for no stream: finish the work that fills or uses the memory first,
    /// or name its stream with [`Descriptor::ordered_after`].
    ///
    /// # Safety
    /// As [`Descriptor::from_raw_parts`].
    ///
    /// # Errors
    /// [`Error::DeviceMismatch`] when `ptr` is not memory on `device`.
    #[cfg(feature = "cuda")]
    #[allow(unsafe_code)] // an unsafe constructor: memory is raw here
    pub unsafe fn from_raw_cuda(ptr: u64, len: usize, device: Device) -> Result<Descriptor<'static>> {
        crate::cuda::verify(ptr as usize, device)?;
        // SAFETY: the caller upholds from_raw_parts's contract.
        Ok(unsafe { Descriptor::from_raw_parts(ptr as *mut u8, len, device) })
    }

    /// Names the CUDA stream that produces (or last uses) this descriptor's device memory: an
    /// operation over the descriptor starts once the work queued on `stream` before the operation
    /// was created is done, and waits for nothing else on the device (not for other streams of the
    /// context, unlike a context-wide synchronisation). `stream` is a `CUstream` of the primary
    /// context of the descriptor's device; `0` or `1` is the legacy default stream, `2` the
    /// per-thread one (a torch tensor's `torch.cuda.current_stream().cuda_stream`, CUDA array
    /// interface's `stream`). Host descriptors ignore it.
    ///
    /// # Safety
    /// `stream` must stay a valid stream of that context for as long as operations over the
    /// descriptor may be created.
    #[cfg(feature = "cuda")]
    #[allow(unsafe_code)] // an unsafe setter: the stream is raw here
    pub unsafe fn ordered_after(mut self, stream: u64) -> Self {
        if let Device::Cuda(ordinal) = self.device() {
            self.set_producer(crate::cuda::Producer::Raw {
                stream: stream as usize,
                ordinal,
            });
        }
        self
    }

    /// The start address and the length.
    fn raw(&self) -> (usize, usize) {
        match &self.mem {
            Mem::Owned(m) => m.raw(),
            Mem::BufferPart { buf, off, len, .. } => (buf.as_ptr() as usize + off, *len),
            Mem::Slice(s) => (s.as_ptr() as usize, s.len()),
            Mem::SliceMut(s) => (s.as_ptr() as usize, s.len()),
            Mem::Raw { ptr, len } | Mem::Extern { ptr, len, .. } => (*ptr, *len),
        }
    }

    /// The start address.
    pub fn ptr(&self) -> usize {
        self.raw().0
    }

    /// The length in bytes.
    pub fn size(&self) -> usize {
        self.raw().1
    }

    /// The device the memory lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// False for shared borrows (`&[u8]`, `&HostBuffer`), which may only be read from.
    pub fn is_writable(&self) -> bool {
        if let Mem::Owned(m) = &self.mem {
            return m.writable();
        }
        !matches!(
            self.mem,
            Mem::Slice(_) | Mem::Extern { writable: false, .. } | Mem::BufferPart { writable: false, .. }
        )
    }

    /// The bytes, for host memory this descriptor owns or borrows (`None` for raw and device
    /// memory).
    pub fn as_slice(&self) -> Option<&[u8]> {
        if self.device != Device::Host {
            return None;
        }
        match &self.mem {
            Mem::Owned(m) => {
                let (p, l) = m.raw();
                if l == 0 {
                    return Some(&[]);
                }
                // SAFETY: the owned memory is live for &self and (p, l) is its byte view.
                #[allow(unsafe_code)]
                let bytes = unsafe { crate::sys::bytes(p, l) };
                Some(bytes)
            }
            Mem::BufferPart { buf, off, len, .. } => Some(&buf[*off..*off + *len]),
            Mem::Slice(s) => Some(s),
            Mem::SliceMut(s) => Some(s),
            Mem::Raw { .. } | Mem::Extern { .. } => None,
        }
    }

    /// Takes back the owned memory (`Vec<T>`, `Box<[T]>`, `HostBuffer`, `BytesMut`) as `T`.
    ///
    /// # Errors
    /// Gives the descriptor back when it does not own a `T`.
    pub fn into_inner<T: OwnedMemory>(self) -> Result<T, Self> {
        if !self.owns::<T>() {
            return Err(self);
        }
        let Mem::Owned(m) = self.mem else {
            unreachable!("owns() is false for borrowed memory")
        };
        Ok(*(m as Box<dyn Any>).downcast().expect("type checked by owns()"))
    }

    /// True when the descriptor owns memory of type `T` (so [`Descriptor::into_inner`] succeeds).
    pub fn owns<T: OwnedMemory>(&self) -> bool {
        match &self.mem {
            Mem::Owned(m) => (&**m as &dyn Any).is::<T>(),
            _ => false,
        }
    }

    /// The range the transports see.
    pub(crate) fn range(&self) -> crate::reg::Range {
        crate::reg::Range {
            addr: self.ptr(),
            len: self.size(),
            device: self.device,
        }
    }

    /// True when it owns a [`HostBuffer`] (which quarantines its own pages when dropped).
    pub(crate) fn is_host_buffer(&self) -> bool {
        matches!(&self.mem, Mem::Owned(m) if m.host_buffer().is_some())
    }

    /// True for a borrowed plain slice (`&[u8]` / `&mut [u8]`): memory the library cannot keep
    /// away from a peer once the borrow ends.
    pub(crate) fn is_plain_borrow(&self) -> bool {
        matches!(self.mem, Mem::Slice(_) | Mem::SliceMut(_))
    }

    /// The bytes of a mutably borrowed slice.
    pub(crate) fn as_mut_slice(&mut self) -> Option<&mut [u8]> {
        match &mut self.mem {
            Mem::SliceMut(s) => Some(s),
            _ => None,
        }
    }

    /// True for raw-pointer descriptors (whose memory only the caller vouches for).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn is_raw(&self) -> bool {
        match &self.mem {
            Mem::Raw { .. } => true,
            Mem::Owned(m) => m.vouched(),
            _ => false,
        }
    }

    /// This descriptor as it appears in [`RdmaMetadata`](crate::RdmaMetadata).
    pub fn metadata(&self) -> SerializedDescriptor {
        SerializedDescriptor {
            device: self.device,
            ptr: self.ptr() as u64,
            size: self.size() as u64,
        }
    }

    /// Records a registration so it lives as long as the memory does.
    pub(crate) fn attach(&mut self, tok: RegToken) {
        let hb = match &self.mem {
            Mem::Owned(m) => m.host_buffer(),
            Mem::BufferPart { buf, .. } => Some(&**buf),
            _ => None,
        };
        if let Some(b) = hb {
            b.keep_registration(tok);
        } else if !self.regs.iter().any(|t| t.same(&tok)) {
            self.regs.push(tok);
        }
    }

    /// Drops the registrations this descriptor keeps (not a [`HostBuffer`]'s, which live as long
    /// as the buffer).
    pub(crate) fn release_registrations(&mut self) {
        self.regs.clear();
    }

    /// True if the descriptor owns its memory (its drop frees it, and the library decides when);
    /// false for borrowed and raw memory, which goes back to its owner when the descriptor is
    /// dropped, so an operation over it must not let go while a transport may touch it.
    pub(crate) fn owns_memory(&self) -> bool {
        matches!(self.mem, Mem::Owned(_))
    }

    /// Drops the borrow lifetime of a descriptor that owns its memory (or wraps a raw pointer), for
    /// example to keep descriptors an operation gave back in a long-lived pool.
    ///
    /// # Errors
    /// Gives the descriptor back when it borrows its memory.
    pub fn try_into_static(mut self) -> Result<Descriptor<'static>, Self> {
        let mem = match std::mem::replace(&mut self.mem, Mem::Slice(&[])) {
            Mem::Owned(m) => Mem::Owned(m),
            Mem::Raw { ptr, len } => Mem::Raw { ptr, len },
            other => {
                self.mem = other;
                return Err(self);
            }
        };
        Ok(Descriptor {
            mem,
            device: self.device,
            regs: self.regs,
            producer: self.producer,
        })
    }
}

/// A dropped operation's owned memory, held by an engine (see [`Held`](crate::reg::Held)).
impl crate::reg::Held for Vec<Descriptor<'static>> {
    fn registrations(&self) -> usize {
        self.iter().map(|d| d.regs.len()).sum()
    }

    fn release_registrations(&mut self) {
        self.iter_mut().for_each(Descriptor::release_registrations);
    }
}

impl fmt::Debug for Descriptor<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Descriptor")
            .field("device", &self.device)
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("size", &self.size())
            .field("writable", &self.is_writable())
            .finish()
    }
}

macro_rules! from_owned {
    ($($(#[$m:meta])* [$($g:tt)*] $t:ty),* $(,)?) => {
        $($(#[$m])* impl<$($g)*> From<$t> for Descriptor<'static> {
            fn from(v: $t) -> Self {
                Descriptor::owned(v)
            }
        })*
    };
}
from_owned!(
    [] HostBuffer,
    /// A read-only descriptor that holds one more reference to a shared [`HostBuffer`]: many
    /// operations, at once or one after another, expose the same memory through one registration.
    [] std::sync::Arc<HostBuffer>,
    [T: Plain] Vec<T>,
    [T: Plain] Box<[T]>,
    [] bytes::BytesMut,
);

impl HostBuffer {
    /// Read-only descriptors over consecutive parts of this buffer, of the given sizes (for a
    /// readable or a write's source over several descriptors). Parts of a `HostBuffer` keep its
    /// registration and its protection on drop, unlike descriptors over plain slices.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the sizes add up to more than the buffer.
    pub fn descriptors(&self, sizes: &[usize]) -> Result<Vec<Descriptor<'_>>> {
        self.parts(sizes, false)
    }

    /// Writable descriptors over consecutive parts of this buffer, of the given sizes (for a
    /// writable or a read's destination over several descriptors).
    ///
    /// # Errors
    /// As [`descriptors`](Self::descriptors).
    pub fn descriptors_mut(&mut self, sizes: &[usize]) -> Result<Vec<Descriptor<'_>>> {
        self.parts(sizes, true)
    }

    /// A read-only descriptor over `range` of this buffer (see [`descriptors`](Self::descriptors)).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the range is not inside the buffer.
    pub fn part(&self, range: std::ops::Range<usize>) -> Result<Descriptor<'_>> {
        self.part_of(range, false)
    }

    fn part_of(&self, range: std::ops::Range<usize>, writable: bool) -> Result<Descriptor<'_>> {
        if range.start > range.end || range.end > self.len() {
            return Err(Error::InvalidArgument(format!(
                "{range:?} is not inside the buffer's {} bytes",
                self.len()
            )));
        }
        let (off, len) = (range.start, range.end - range.start);
        Ok(Descriptor::make(
            Mem::BufferPart {
                buf: self,
                off,
                len,
                writable,
            },
            Device::Host,
        ))
    }

    /// A descriptor over the whole buffer (`writable` when borrowed mutably).
    fn whole(&self, writable: bool) -> Descriptor<'_> {
        self.part_of(0..self.len(), writable)
            .expect("the whole buffer is inside it")
    }

    fn parts(&self, sizes: &[usize], writable: bool) -> Result<Vec<Descriptor<'_>>> {
        let total = sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s));
        if total.is_none_or(|t| t > self.len()) {
            return Err(Error::InvalidArgument(format!(
                "descriptor sizes add up to more than the buffer's {} bytes",
                self.len()
            )));
        }
        let mut off = 0;
        sizes
            .iter()
            .map(|&len| {
                off += len;
                self.part_of(off - len..off, writable)
            })
            .collect()
    }
}

impl<'a> From<&'a HostBuffer> for Descriptor<'a> {
    fn from(b: &'a HostBuffer) -> Self {
        b.whole(false)
    }
}
impl<'a> From<&'a mut HostBuffer> for Descriptor<'a> {
    fn from(b: &'a mut HostBuffer) -> Self {
        b.whole(true)
    }
}
impl<'a> From<&'a [u8]> for Descriptor<'a> {
    fn from(s: &'a [u8]) -> Self {
        Descriptor::make(Mem::Slice(s), Device::Host)
    }
}
impl<'a> From<&'a mut [u8]> for Descriptor<'a> {
    fn from(s: &'a mut [u8]) -> Self {
        Descriptor::make(Mem::SliceMut(s), Device::Host)
    }
}

/// One or more descriptors, as the operations take them: a single [`Descriptor`], a
/// `Vec<Descriptor>` or an array.
#[derive(Debug)]
pub struct Descriptors<'a>(pub(crate) Vec<Descriptor<'a>>);

impl<'a> From<Descriptor<'a>> for Descriptors<'a> {
    fn from(d: Descriptor<'a>) -> Self {
        Descriptors(vec![d])
    }
}
impl<'a> From<Vec<Descriptor<'a>>> for Descriptors<'a> {
    fn from(v: Vec<Descriptor<'a>>) -> Self {
        Descriptors(v)
    }
}
impl<'a, const N: usize> From<[Descriptor<'a>; N]> for Descriptors<'a> {
    fn from(v: [Descriptor<'a>; N]) -> Self {
        Descriptors(v.into())
    }
}

/// Checks a local list: non-empty, one device kind, writable when `dest`.
pub(crate) fn check_local(descs: &[Descriptor<'_>], dest: bool) -> Result<()> {
    let first = descs
        .first()
        .ok_or_else(|| Error::InvalidArgument("the descriptor list is empty".into()))?;
    if descs.iter().any(|d| d.device().kind() != first.device().kind()) {
        return Err(Error::InvalidArgument(
            "the descriptor list mixes device kinds; one operation moves one kind of memory".into(),
        ));
    }
    // Refuses the first descriptor that is `bad`, for `why`.
    let refuse = |bad: fn(&Descriptor<'_>) -> bool, why: &str| match descs.iter().position(bad) {
        Some(i) => Err(Error::InvalidArgument(format!("descriptor {i} {why}"))),
        None => Ok(()),
    };
    if dest {
        refuse(
            |d| !d.is_writable(),
            "borrows read-only memory (&[u8] or &HostBuffer) but would be written into; pass &mut or \
             owned memory",
        )?;
    }
    refuse(|d| d.ptr() == 0, "has a null pointer")?;
    refuse(
        |d| d.ptr().checked_add(d.size()).is_none(),
        "wraps past the end of the address space",
    )?;
    // Raw pointers are only as good as the caller's word: the driver knows where CUDA memory is,
    // and device memory claimed as host memory (or the other way round) must never reach NIXL.
    #[cfg(feature = "cuda")]
    for d in descs.iter().filter(|d| d.is_raw()) {
        crate::cuda::verify(d.ptr(), d.device())?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
